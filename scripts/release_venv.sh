#!/usr/bin/env bash
# The venv of one vLLM release for the release matrix (issue 48): bash scripts/release_venv.sh VERSION
# prints its python's path, installing it first when it is not there.
#
# Shared by every clone on this machine, outside them: $PDTRACE_VENVS (default ~/.cache/pdtrace/venvs).
# - base-HASH: one install of everything but vLLM: the CPU torch 2.13.0 wheel, the pure-Python
#   packages vLLM's scheduler, connector and worker code import (the list scripts/install.sh uses),
#   gguf and diskcache (imported at module level by 0.22-0.23 / 0.19), xgrammar, and pdtrace's own
#   and its tests' dependencies (pyproject.toml), not pdtrace itself.
# - vllm-VERSION-HASH: the release's `vllm` wheel --no-deps, nothing else; a .pth line adds the
#   base's site-packages after its own, so it imports the base's packages.
# pdtrace is not installed in either: the caller runs the clone's code with PYTHONPATH=<clone>, so
# one venv serves every clone and no clone's checkout is baked into it. HASH is this file's and
# pyproject.toml's: a change to either makes new venvs (the old ones of the same kind are removed).
# About 1.6 GB for the base and 0.5-1.2 GB per release, once per machine instead of ~2.2 GB per
# release per clone; a release venv installs in about 30 s once the base is there.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [[ ! "$1" =~ ^0\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: bash scripts/release_venv.sh VERSION   (a vLLM release, e.g. 0.24.0)" >&2
  exit 2
fi
V=$1
PY=${PYTHON:-python3}
VENVS=${PDTRACE_VENVS:-$HOME/.cache/pdtrace/venvs}
mkdir -p "$VENVS"
HASH=$(cat scripts/release_venv.sh pyproject.toml | sha1sum | cut -c1-10)
BASE=$VENVS/base-$HASH
REL=$VENVS/vllm-$V-$HASH
exec 9>"$VENVS/.lock"
flock 9  # one installer at a time (two clones' CI, or test.sh beside a hand run)
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
LOG=$VENVS/install-$V.log  # the installers' output; its tail is printed when one fails
: >"$LOG"
fail() { tail -15 "$LOG" >&2; echo "release_venv: $1 failed (log: $LOG)" >&2; exit 2; }
if [ ! -f "$BASE/.complete" ]; then
  for old in "$VENVS"/base-*; do [ -e "$old" ] && [ "$old" != "$BASE" ] && rm -rf "$old"; done
  rm -rf "$BASE"
  echo "release_venv: installing the shared base into $BASE" >&2
  {
  "$PY" -m venv "$BASE" &&
  "$BASE/bin/pip" install -q --upgrade pip &&
  "$BASE/bin/pip" install -q torch==2.13.0 &&
  "$BASE/bin/pip" install -q torch==2.13.0 numpy packaging regex pydantic cbor2 psutil pyzmq urllib3 transformers \
    aiohttp requests openai-harmony openai pillow pybase64 cachetools prometheus_client msgspec cloudpickle uvloop \
    py-cpuinfo fastapi partial_json_parser "llguidance>=1.7,<1.8" "apache-tvm-ffi==0.1.11" einops gguf diskcache &&
  "$BASE/bin/pip" install -q --no-deps xgrammar
  } >>"$LOG" 2>&1 || fail "installing the shared base"
  # pdtrace's dependencies and its test extra, read from pyproject.toml (pdtrace itself stays in the clone)
  "$BASE/bin/python" - <<'EOF' >"$BASE/pdtrace-deps.txt"
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))
EOF
  "$BASE/bin/pip" install -q -r "$BASE/pdtrace-deps.txt" >>"$LOG" 2>&1 || fail "installing pdtrace's dependencies"
  touch "$BASE/.complete"
fi
if [ ! -f "$REL/.complete" ]; then
  for old in "$VENVS"/vllm-"$V"-*; do [ -e "$old" ] && [ "$old" != "$REL" ] && rm -rf "$old"; done
  rm -rf "$REL"
  echo "release_venv: installing vLLM $V into $REL" >&2
  "$PY" -m venv "$REL" >>"$LOG" 2>&1 || fail "making the venv $REL"
  echo "import site; site.addsitedir('$(site "$BASE")')" >"$(site "$REL")/_pdtrace_base.pth"
  "$REL/bin/pip" install -q --no-deps "vllm==$V" >>"$LOG" 2>&1 || fail "installing vllm==$V"
  VLLM_TARGET_DEVICE=cpu "$REL/bin/python" -c "import vllm, torch, pytest; assert vllm.__version__.split('+')[0] == '$V', vllm.__version__" \
    >>"$LOG" 2>&1 || fail "importing vLLM $V"
  touch "$REL/.complete"
fi
echo "$REL/bin/python"
