#!/usr/bin/env bash
# The seed bugs in a real vLLM release, from its own code (issue 34): bash scripts/real_bugs.sh VERSION
#
# 1. Installs vLLM VERSION into its own venv, .venv-vllm-VERSION (reused when it is there): the `vllm`
#    wheel --no-deps next to the CPU torch 2.13.0 and the pure-Python packages its scheduler,
#    connector and worker code import (scripts/install.sh with VLLM_SPEC / VENV; gguf added for the
#    releases that import it at module level). Its CUDA kernels do not load here; the Python code
#    the scenarios drive does.
# 2. Runs pdtrace.testing.real_release in that venv: the P/D lookahead sweep (seed 000/001), the
#    DFlash window (seed 003), the accepted-count read (seed 004), the KV-load rollback (vLLM #49250,
#    #45138, open upstream) and a hybrid model's failed load (#50687 / #56855) on the release's own code,
#    one trace per family under real_bugs/VERSION/, checked with `pdtrace check -f json`.
# 3. Prints, as its last line, one JSON object: {"vllm", "scenarios", "flagged", "expected",
#    "doctor_skipped", "families"}. Exit 0 when flagged == expected, 1 when not, 2 on a usage or
#    install error.
# The live GPU half of issue 34 (a real 0.24.0 P/D + EAGLE under `pdtrace record`) runs on a GPU
# machine through scripts/gpu_run.sh; this script says so when it sees a GPU and does not run it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [[ ! "$1" =~ ^0\.[0-9]+\.[0-9]+$ ]]; then
  [ $# -ge 1 ] && echo "real_bugs: '$1' is not a vLLM release version (MAJOR.MINOR.PATCH)" >&2
  echo "usage: bash scripts/real_bugs.sh VERSION   (a vLLM release, e.g. 0.24.0)" >&2
  exit 2
fi
V=$1
VENV=${VENV:-.venv-vllm-$V}  # scripts/test.sh passes .venv (0.32.0) and .venv-vllm033 (0.33.0) for the two main ones
OUT=real_bugs/$V
log=$(mktemp)
if ! "$VENV/bin/python" -c "import vllm, pdtrace, sys; sys.exit(vllm.__version__.split('+')[0] != '$V')" 2>/dev/null; then
  echo "real_bugs: installing vLLM $V into $VENV (log: $log)" >&2
  if ! VLLM_SPEC="vllm==$V" VENV="$VENV" bash scripts/install.sh >"$log" 2>&1; then
    tail -5 "$log" >&2
    echo "real_bugs: installing vLLM $V failed (log: $log)" >&2
    exit 2
  fi
  # imported at module level by older releases' scheduler code: gguf (0.22-0.23), diskcache (0.19)
  "$VENV/bin/pip" install -q gguf diskcache >>"$log" 2>&1 || true
  rm -f "$log"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "real_bugs: a GPU is here; the live P/D half runs with scripts/gpu_run.sh (docs/live-gpu.md)" >&2
fi
# VLLM_TARGET_DEVICE=cpu: the CPU platform where the release honours it (0.26 on); the scenarios
# need no platform otherwise. vLLM's own logging goes to stderr.
# Kept for scripts/release_matrix.py (docs/releases.md, README's support matrix): the JSON line
# (real_bugs/VERSION.json) and `pdtrace doctor --json` on this release (real_bugs/VERSION.doctor.json).
mkdir -p real_bugs
rc=0
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pdtrace.testing.real_release "$OUT" 2>"$OUT.log" | tail -1 \
  | tee "real_bugs/$V.json" || rc=$?
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pdtrace doctor --json >"real_bugs/$V.doctor.json" 2>>"$OUT.log" || true
exit $rc
