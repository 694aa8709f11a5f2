#!/usr/bin/env bash
# The test command (README, and .ci/run): install from scratch if needed, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --live
. .venv/bin/activate
python -m pytest -q "$@"
