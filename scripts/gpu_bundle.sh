#!/usr/bin/env bash
# Build .gpu/: what scripts/gpu_run.sh needs on a GPU host that cannot reach a package index
# (this project's lent GPU machines: CUDA torch 2.11 + Triton preinstalled, no vLLM, no NIXL,
# nothing fetchable, at most 64 MiB carried per call).
#
#   bash scripts/gpu_bundle.sh          # -> .gpu/ (~50 MB) and .gpuc/, ignored by git (.git/info/exclude)
#
# What goes in, and what is left out to fit:
#   .gpu/vllm.tar.xz   the CUDA `vllm==0.32.0` wheel's Python code only. Left out: every compiled
#                      kernel library (_C_stable_libtorch, flash-attn fa2/fa3, MoE, DeepGEMM, FlashMLA;
#                      ~700 MB) and the vllm-rs binary. The run therefore uses vLLM's own fallbacks:
#                      --attention-backend TRITON_ATTN and compilation custom_ops ["none"] (the
#                      torch-native forward of RMSNorm / SiluAndMul / rotary embedding).
#   .gpu/nixl.tar.xz   the nixl-cu13 1.5.1 wheel's files without nixl_ep_cu13 (expert-parallel
#                      kernels vLLM's NixlConnector does not load).
#   .gpu/whl/          cp312 wheels of the pure-Python / small packages vLLM's server imports and the
#                      GPU image lacks (the set tests/ runs with on CPU), and pdtrace's own.
# vLLM 0.32.0 pins torch 2.13.0; the GPU image has torch 2.11.0: a known gap, said in every note.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${VLLM:-0.32.0}
# BUNDLE names the folder pair (default .gpu / .gpuc); another release beside 0.32.0's:
#   VLLM=0.24.0 BUNDLE=.gpu024 bash scripts/gpu_bundle.sh   # -> .gpu024/, .gpu024c/
OUT=${BUNDLE:-.gpu}
COUT=${BUNDLE:+${BUNDLE}c}; COUT=${COUT:-.gpuc}
TMP=$(mktemp -d /tmp/pdtrace-gpu-bundle-XXXX)
trap 'rm -rf "$TMP"' EXIT
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >> .git/info/exclude
rm -rf "$OUT" && mkdir -p "$OUT/whl"
PIP=${PIP:-pip}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
"$PIP" download -q --no-deps "${PLAT[@]}" -d "$TMP" "vllm==$VLLM" nixl-cu13==1.5.1

mkdir "$TMP/v" && (cd "$TMP/v" && unzip -q "$TMP"/vllm-*.whl)
# .gpuc/cstable.xz: vLLM's kernel library alone, for a second call (it does not fit beside .gpu/):
# every run needs it (model inspection imports torch.ops._C ops, for the tiny Llama as for the hybrid model).
grep -qx "/$COUT/" .git/info/exclude 2>/dev/null || echo "/$COUT/" >> .git/info/exclude
# Its device code for GPUs other than Hopper is zeroed first (scripts/prune_fatbin.py; SM=90): 0.24.0's
# library compresses to 81 MB whole, more than a call takes, and to 29 MB pruned.
rm -rf "$COUT" && mkdir -p "$COUT"
python3 scripts/prune_fatbin.py --sm "${SM:-90}" "$TMP/v/vllm/_C_stable_libtorch.abi3.so" "$TMP/cstable.so"
xz -T2 -9 -c "$TMP/cstable.so" > "$COUT/cstable.xz"
find "$TMP/v" \( -name '*.so' -o -name vllm-rs -o -name '*.cu' -o -name '*.cuh' -o -name '*.hpp' \) -delete
rm -rf "$TMP/v/vllm/third_party/deep_gemm/include" "$TMP/v/vllm/third_party/fmha_sm100/cutlass"
(cd "$TMP/v" && tar cf - vllm vllm-*.dist-info) | xz -T2 -6 > "$OUT/vllm.tar.xz"

mkdir "$TMP/n" && (cd "$TMP/n" && unzip -q "$TMP"/nixl_cu13-*.whl && rm -rf nixl_ep_cu13)
(cd "$TMP/n" && tar cf - .) | xz -T2 -6 > "$OUT/nixl.tar.xz"

# Versions: those the CPU test environment (scripts/install.sh --live) resolves and runs with.
"$PIP" download -q --no-deps "${PLAT[@]}" -d "$OUT/whl" \
  nixl==1.5.1 annotated-types==0.8.0 apache-tvm-ffi==0.1.11 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 \
  compressed-tensors==0.17.0 fastapi==0.165.0 httpcore2==2.16.2 httpx2==2.16.2 ijson==3.6.0 jiter==0.19.0 \
  jmespath==1.1.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 llguidance==1.7.6 loguru==0.7.3 \
  model-hosting-container-standards==0.1.16 msgspec==0.22.0 openai==3.57.0 openai-harmony==0.0.8 \
  opentelemetry-api==1.45.2 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 \
  prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 \
  python-json-logger==4.2.0 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 \
  sniffio==1.3.1 starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5 typing-inspection==0.4.5 \
  uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.8 zstandard==0.25.0 platformdirs==4.14.8 shellingham==1.5.4
du -sh "$OUT"/* "$COUT"/* | sed 's/^/gpu_bundle: /'
