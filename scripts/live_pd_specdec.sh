#!/usr/bin/env bash
# Live P/D + EAGLE speculative decoding on ONE GPU, recorded with pdtrace (issue 7's GPU recipe).
#
# Needs, on the GPU host, with no internet: Python 3.10+, the CUDA wheel vllm==0.32.0 (with its
# torch), nixl==1.5.1 (UCX), and pdtrace (`pip install -e .` from this repo; transformers and
# tokenizers come with vLLM). It builds a tiny random-weight Llama-style target and an
# EAGLE-style drafter locally (scripts/make_tiny_models.py), starts a prefill (kv_producer) and
# a decode (kv_consumer) `vllm.entrypoints.openai.api_server` with NixlConnector on 127.0.0.1,
# each under `pdtrace record`, sends prompts whose lengths are multiples of the block size (and
# some that are not) through scripts/pd_proxy.py, merges the two traces and runs `pdtrace check`.
# It is scripts/live_cpu_pd.py with PDTRACE_LIVE_DEVICE=cuda (KV buffers on the GPU, fp16, each
# server at --gpu-memory-utilization 0.35).
#
#   bash scripts/live_pd_specdec.sh [WORKDIR]
#
# Status: run on one H100 on 2026-11-25 through scripts/gpu_run.sh (which adds what that machine
# needed: Triton attention, no flash-attn / flashinfer; docs/live-gpu.md), model runner V2 and V1;
# the merged traces are sample_traces/live_gpu_pd_eagle_v{1,2}.jsonl.zst. Extra server arguments:
# PDTRACE_LIVE_EXTRA_ARGS (JSON list), PDTRACE_LIVE_SPEC_EXTRA (JSON object), PDTRACE_LIVE_KV_BUFFER.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-$(mktemp -d /tmp/pdtrace-live-gpu-XXXX)}
export PDTRACE_LIVE_DEVICE=cuda
python scripts/live_cpu_pd.py --workdir "$WORKDIR" --block-size 16 --spec eagle --num-spec 3
echo "traces: $WORKDIR/P.jsonl $WORKDIR/D.jsonl; merged: $WORKDIR/merged.jsonl (pdtrace check / view / report it)"
