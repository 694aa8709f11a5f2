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
# Status: written and run on CPU only (same script, device=cpu: tests/test_live_cpu.py). Not yet
# run on a GPU: the session that wrote it had no GPU lent. A run's merged trace belongs in
# sample_traces/ labelled "live GPU run" with its sidecar and a provenance line.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-$(mktemp -d /tmp/pdtrace-live-gpu-XXXX)}
export PDTRACE_LIVE_DEVICE=cuda
python scripts/live_cpu_pd.py --workdir "$WORKDIR" --block-size 16 --spec eagle --num-spec 3
echo "traces: $WORKDIR/P.jsonl $WORKDIR/D.jsonl; merged: $WORKDIR/merged.jsonl (pdtrace check / view / report it)"
