#!/usr/bin/env bash
# The seed bugs in a real vLLM release, from its own code (issue 34): bash scripts/real_bugs.sh VERSION
#
# 1. Gets the release's venv: scripts/release_venv.sh (shared by every clone on the machine, outside
#    it: the `vllm` wheel --no-deps over one shared install of the CPU torch 2.13.0 and the pure-Python
#    packages its scheduler, connector and worker code import). Its CUDA kernels do not load here; the
#    Python code the scenarios drive does. pdtrace runs from this clone (PYTHONPATH). VENV=DIR uses
#    that venv instead (scripts/test.sh: .venv for 0.32.0, .venv-vllm033 for 0.33.0).
# 2. Runs pdtrace.testing.real_release in that venv: the P/D lookahead sweep (seed 000/001), the
#    DFlash window (seed 003), the accepted-count read (seed 004), the KV-load rollback (vLLM #49250,
#    #45138, open upstream), a hybrid model's failed load (#50687 / #56855), the token of the step in
#    flight at a rollback and a shared failed block (issue 50), and prompts whose params a router
#    dropped on the way to D (issue 51's labelled fault) on the release's own code,
#    one trace per family under real_bugs/VERSION/, checked with `pdtrace check -f json`.
# 3. Prints, as its last line, one JSON object: {"vllm", "scenarios", "flagged", "expected",
#    "doctor_skipped", "families"}. Exit 0 when flagged == expected, 1 when not, 2 on a usage or
#    install error.
# 4. The architecture zoo on the release (pdtrace.testing.zoo): real_bugs/VERSION.zoo.json, exit 1 on
#    a finding on correct vLLM or a mismatch with the release's own block lists.
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
OUT=real_bugs/$V
# The two main releases: the venv CI runs them in (scripts/test.sh), when this clone has it. A --no-deps
# release venv lacks packages those have (NIXL, a model's own deps), and the matrix CI checks then differs.
if [ -z "${VENV:-}" ] && [ "$V" = 0.32.0 ] && [ -x .venv/bin/python ]; then VENV=.venv; fi
if [ -z "${VENV:-}" ] && [ "$V" = 0.33.0 ] && [ -x .venv-vllm033/bin/python ]; then VENV=.venv-vllm033; fi
if [ -z "${VENV:-}" ] && [[ "$V" =~ ^0\.3[23]\.0$ ]]; then
  echo "real_bugs: no CI venv for $V here (scripts/test.sh --all builds it); a release venv's doctor and zoo rows may differ from CI's" >&2
fi
if [ -n "${VENV:-}" ]; then
  PYBIN=$VENV/bin/python
  "$PYBIN" -c "import vllm, sys; sys.exit(vllm.__version__.split('+')[0] != '$V')" 2>/dev/null || {
    echo "real_bugs: $VENV does not hold vLLM $V" >&2; exit 2; }
else
  PYBIN=$(bash scripts/release_venv.sh "$V") || { echo "real_bugs: installing vLLM $V failed" >&2; exit 2; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "real_bugs: a GPU is here; the live P/D half runs with scripts/gpu_run.sh (docs/live-gpu.md)" >&2
fi
# VLLM_TARGET_DEVICE=cpu: the CPU platform where the release honours it (0.26 on); the scenarios
# need no platform otherwise. vLLM's own logging goes to stderr.
# Kept for scripts/release_matrix.py (docs/releases.md, README's support matrix): the JSON line
# (real_bugs/VERSION.json) and `pdtrace doctor --json` on this release (real_bugs/VERSION.doctor.json).
mkdir -p real_bugs
rc=0
VLLM_TARGET_DEVICE=cpu "$PYBIN" -m pdtrace.testing.real_release "$OUT" 2>"$OUT.log" | tail -1 \
  | tee "real_bugs/$V.json" || rc=$?
VLLM_TARGET_DEVICE=cpu "$PYBIN" -m pdtrace doctor --json >"real_bugs/$V.doctor.json" 2>>"$OUT.log" || true
# The architecture zoo at engine-core level on this release (issue 47; bash scripts/arch_zoo.sh --vllm V):
# each family's KV cache groups as the release builds them, P/D requests through its scheduler side; a
# finding on correct vLLM or a mismatch with its own block lists fails (exit 1); a family the release
# cannot build here (exit 4) is said in real_bugs/V.zoo.json, the README's zoo column.
zrc=0
VLLM_TARGET_DEVICE=cpu "$PYBIN" -m pdtrace.testing.zoo >"$OUT.zoo.jsonl" 2>>"$OUT.log" || zrc=$?
tail -1 "$OUT.zoo.jsonl" >"real_bugs/$V.zoo.json"
if [ $zrc = 1 ] || [ $zrc -gt 4 ] || [ $zrc = 2 ] || [ $zrc = 3 ]; then
  echo "real_bugs: the architecture zoo on $V exited $zrc (real_bugs/$V.zoo.json)" >&2; rc=1
fi
exit $rc
