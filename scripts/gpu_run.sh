#!/usr/bin/env bash
# Run the live P/D + EAGLE recipe (scripts/live_pd_specdec.sh's run, scripts/live_cpu_pd.py with
# PDTRACE_LIVE_DEVICE=cuda) on a GPU host with no package index, twice: model runner V2 (vLLM's
# default on GPUs) and V1 (VLLM_USE_V2_MODEL_RUNNER=0). Needs .gpu/ from scripts/gpu_bundle.sh.
#
#   OUT=/some/dir bash scripts/gpu_run.sh [v2] [v1] [v2-ring] [v1-ring] [hybrid-v2] [hybrid-v1] [race] [overhead] [boundary]
#   (default: v2 v1)
# overhead: bench/live_overhead_gpu.py (issue 38), OVH_BUDGET (420) seconds, OVH_ARGS passed on,
# OVH_RUNNER v2 (default) or v1; writes overhead.json.
# (*-ring: the same P/D run with every server under `pdtrace record --ring ${RING_S:-20}`)
# UNPACK_ONLY=1: unpack .gpu/ (and .gpuc/, vLLM's kernel library, when carried) into $SITE and stop.
# (hybrid-*: scripts/live_cpu_hybrid.py, one tiny Mamba-2 + attention server with ngram spec decode,
# the model for which vLLM copies accepted counts to the CPU on V1 and keeps them on the GPU on V2)
# race: vLLM #51571's configuration (docs/live-gpu.md): the tiny hybrid model, ngram_gpu k=3,
# --async-scheduling, prefix caching on (Mamba "align" mode), model runner V1, RACE_LOAD (480)
# requests 16 at a time; two servers at once on the GPU: vLLM 0.32.0 as released ("bug") and the
# same with the labelled patch scripts/patches/vllm_pr51599_approach.py ("fix"), each recorded.
# Writes race-bug.jsonl.zst, race-fix.jsonl.zst, race-*.out (result + check) and race-logs.tgz.
# boundary: issue 52 item 1 (seed 000 live): the block-boundary load on vLLM 0.24.0 (.gpu024/ and .gpu024c/ from
# `VLLM=0.24.0 BUNDLE=.gpu024 bash scripts/gpu_bundle.sh`, into $SITE024) and 0.32.0 at once; writes
# boundary-<024|032>.jsonl.zst and .tgz (result.json, check.json, oracle.json, logs).
# Every mode needs vLLM's kernel library (model inspection imports torch.ops._C ops, for the tiny
# Llama too: a call of 2026-11-27 without it failed every server with "no attribute
# 'cutlass_scaled_mm_supports_block_fp8'"): carry .gpu in a first call (UNPACK_ONLY=1, or any mode:
# it fails fast), then .gpuc (gpu_bundle.sh) in the call that runs, within 30 s (the machine's idle limit).
#
# Writes under $OUT: gpu_run.log (environment, doctor, both reports), merged-<mode>.jsonl.zst
# (the merged P+D trace) and logs-<mode>.tgz (server logs, result.json, check.json).
# The vLLM it runs has no compiled kernels (see gpu_bundle.sh): attention is vLLM's
# TRITON_ATTN backend and RMSNorm / SiluAndMul / rotary run their torch-native forward.
# For this project's lent GPU machines only: it kills every vllm.entrypoints process between runs and
# patches the vLLM it unpacks (flash-attn import, kernel-library stub). Never run it on a shared host.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pdtrace-gpu-out}
SITE=${SITE:-/tmp/pdtrace-site}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
MODES=("$@"); [ ${#MODES[@]} -gt 0 ] || MODES=(v2 v1)
PER_RUN=${PER_RUN:-250}
say() { echo "== gpu_run +$((SECONDS))s: $*"; }

# unpack_site SITE BUNDLE: the wheels and NIXL of .gpu/, vLLM's Python code of BUNDLE/ (.gpu/, or another
# release's, e.g. .gpu024/ from VLLM=0.24.0 BUNDLE=.gpu024 gpu_bundle.sh) and, when carried, its kernel
# library from BUNDLEc/ (a later call's carry: it does not fit beside .gpu/)
unpack_site() {
  local site=$1 b=$2
  if [ ! -e "$site/vllm/__init__.py" ] && [ -e "$b/vllm.tar.xz" ]; then
    say "unpacking .gpu and $b into $site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/whl/*.whl || return 3
    tar xJf "$b/vllm.tar.xz" -C "$site" && tar xJf .gpu/nixl.tar.xz -C "$site" || return 3
    # the `nixl` wheel's nixl_ep dispatcher, whose nixl_ep_cu13 is not carried: vLLM's _has_module("nixl_ep")
    # finds it, fails to import it and logs a traceback into every `pdtrace doctor` (seen 2026-11-27)
    rm -rf "$site/nixl_ep"
  fi
  if [ -e "${b}c/cstable.xz" ] && [ -e "$site/vllm/__init__.py" ] && [ ! -e "$site/vllm/_C_stable_libtorch.abi3.so" ]; then
    say "unpacking ${b}c/cstable.xz into $site"; rm -f "$site/vllm/_C_stable_libtorch.py"
    xz -dc "${b}c/cstable.xz" > "$site/vllm/_C_stable_libtorch.abi3.so" || return 3
  fi
  return 0
}
# 0.24.0 beside 0.32.0 (mode boundary): its own site, from .gpu024/ and .gpu024c/ when carried
SITE024=${SITE024:-/tmp/pdtrace-site-024}
unpack_site "$SITE" .gpu || exit 3
unpack_site "$SITE024" .gpu024 || exit 3
[ "${UNPACK_ONLY:-0}" = 1 ] && { say "unpacked only"; ls "$SITE/vllm/_C_stable_libtorch"* "$SITE024/vllm/_C_stable_libtorch"* 2>/dev/null; exit 0; }
# pdtrace itself, every time (a warm machine keeps $SITE from an earlier call)
for site in "$SITE" "$SITE024"; do
  [ -e "$site/vllm/__init__.py" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" . || exit 3
  # vllm/vllm_flash_attn/__init__.py raises ImportError when neither flash-attn extension loads, and
  # vllm/v1/attention/backends/fa_utils.py imports it unguarded on CUDA (model inspection imports it
  # through layers/attention): turn that one raise into a no-op. Nothing calls flash-attn with
  # --attention-backend TRITON_ATTN; a call would fail on the missing extension, loudly.
  python3 - "$site/vllm/vllm_flash_attn/__init__.py" <<'PYEOF'
import sys
p = sys.argv[1]; s = open(p).read()
old = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
if old in s:
    open(p, "w").write(s.replace(old, "if False:  # pdtrace gpu_run.sh: flash-attn not carried\n    raise ImportError("))
PYEOF
done
if [ ! -e "$SITE/vllm/_C_stable_libtorch.py" ]; then
  # vllm/platforms/cuda.py imports vllm._C_stable_libtorch unguarded; the library is not carried
  # (gpu_bundle.sh), so an empty module stands in: torch.ops._C stays empty, and the servers run
  # the Triton / torch-native paths chosen by $EXTRA below. Any op that has no such path fails loudly.
  [ -e "$SITE/vllm/_C_stable_libtorch.abi3.so" ] || \
    echo '# pdtrace scripts/gpu_run.sh: vLLM kernel library not carried to this host' > "$SITE/vllm/_C_stable_libtorch.py"
fi
export PYTHONPATH=$SITE
# flashinfer is not carried: the V2 sampler asks for its top-k/top-p kernels unless told not to
export VLLM_USE_FLASHINFER_SAMPLER=0
say "environment"
nvidia-smi -L
python3 - <<'EOF'
import torch, triton, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
import vllm, nixl, pdtrace
print("vllm", vllm.__version__, "nixl backend", nixl.__name__, "pdtrace", pdtrace.__version__)
from vllm.platforms import current_platform as p
print("platform", type(p).__name__, p.device_type)
EOF
say "pdtrace doctor"
python3 -m pdtrace doctor

EXTRA='["--attention-backend","TRITON_ATTN","--compilation-config","{\"custom_ops\":[\"none\"]}"]'
for mode in "${MODES[@]}"; do
  if [ "$mode" = overhead ]; then
    # issue 38: bench/live_overhead_gpu.py, P/D + EAGLE pairs (plain, plain, recorded per model size)
    # pinned to disjoint cores, each load served alone on the GPU; OVH_BUDGET seconds in all
    # the runner is OVH_RUNNER's (v2, vLLM's default, unless OVH_RUNNER=v1), not what an earlier mode of
    # this call exported (a call of 2026-11-27 measured V1 after `race` had set VLLM_USE_V2_MODEL_RUNNER=0)
    if [ "${OVH_RUNNER:-v2}" = v1 ]; then export VLLM_USE_V2_MODEL_RUNNER=0; else unset VLLM_USE_V2_MODEL_RUNNER; fi
    say "overhead: recorded vs plain, live P/D + EAGLE, model runner ${OVH_RUNNER:-v2}"
    unset PDTRACE_LIVE_RECORD_ARGS
    export PDTRACE_LIVE_DEVICE=cuda PDTRACE_LIVE_EXTRA_ARGS=$EXTRA PDTRACE_LIVE_KV_BUFFER=cuda OMP_NUM_THREADS=1 \
      PDTRACE_LIVE_SPEC_EXTRA='{"attention_backend":"TRITON_ATTN"}'
    timeout -k 20 "$((${OVH_BUDGET:-420} + 60))" python3 bench/live_overhead_gpu.py --device cuda \
      --deadline-s "${OVH_BUDGET:-420}" --json "$OUT/overhead.json" ${OVH_ARGS:-}
    say "overhead rc=$?"
    pkill -9 -f vllm.entrypoints 2>/dev/null; pkill -9 -f "pdtrace record" 2>/dev/null; sleep 1
    continue
  fi
  if [ "$mode" = race ]; then
    FIXSITE=/tmp/pdtrace-site-fix51599
    rm -rf "$FIXSITE" && cp -a "$SITE" "$FIXSITE" || exit 3
    python3 scripts/patches/vllm_pr51599_approach.py "$FIXSITE/vllm/v1/worker/gpu_model_runner.py" || exit 3
    say "race: vLLM 0.32.0 as released and with the PR #51599 approach, V1 runner, align mode, async"
    export VLLM_USE_V2_MODEL_RUNNER=0 PDTRACE_LIVE_DEVICE=cuda PDTRACE_LIVE_EXTRA_ARGS=$EXTRA
    unset PDTRACE_LIVE_RECORD_ARGS
    HARGS=(--spec ngram_gpu --async-scheduling --prefix-caching --max-num-seqs 16 --load "${RACE_LOAD:-480}"
           --concurrency 16)
    rm -rf /tmp/pdtrace-live-race-bug /tmp/pdtrace-live-race-fix
    timeout -k 10 "$PER_RUN" python3 scripts/live_cpu_hybrid.py --workdir /tmp/pdtrace-live-race-bug "${HARGS[@]}" \
      > "$OUT/race-bug.out" 2>&1 &
    pid_bug=$!
    PYTHONPATH=$FIXSITE timeout -k 10 "$PER_RUN" python3 scripts/live_cpu_hybrid.py \
      --workdir /tmp/pdtrace-live-race-fix "${HARGS[@]}" > "$OUT/race-fix.out" 2>&1 &
    pid_fix=$!
    # the two runs only: a bare `wait` also waits for the tee of this script's own output (exec above),
    # which never ends (a GPU call of 2026-11-26 hung here until its time limit)
    wait "$pid_bug" "$pid_fix"
    say "race done"
    for side in bug fix; do
      wd=/tmp/pdtrace-live-race-$side
      [ -s "$wd/H.jsonl" ] && python3 -m pdtrace merge "$wd/H.jsonl" -o "$OUT/race-$side.jsonl.zst"
      tail -c 3000 "$OUT/race-$side.out"
    done
    (cd /tmp && tar czf "$OUT/race-logs.tgz" --exclude=models --exclude='*.jsonl' --exclude='*.pdshard' \
       pdtrace-live-race-bug pdtrace-live-race-fix) || true
    continue
  fi
  if [ "$mode" = boundary ]; then
    # issue 52 item 1: seed 000 live. The same block-boundary load (BOUNDARY_N distinct prompts, every
    # residue of block size 16, each disaggregated and locally on P) on vLLM 0.24.0 (the last release
    # with the bug) and 0.32.0, two P/D + EAGLE pairs at once on the GPU, every server recorded;
    # scripts/boundary_oracle.py holds `pdtrace check` to the tokens and vLLM's own block lists.
    unset VLLM_USE_V2_MODEL_RUNNER PDTRACE_LIVE_RECORD_ARGS
    export PDTRACE_LIVE_DEVICE=cuda PDTRACE_LIVE_EXTRA_ARGS=$EXTRA PDTRACE_LIVE_KV_BUFFER=cuda PDTRACE_LIVE_GPU_UTIL=0.2 \
      PDTRACE_LIVE_SPEC_EXTRA='{"attention_backend":"TRITON_ATTN"}'
    pids=()
    for rel in ${BOUNDARY_RELEASES:-024 032}; do
      site=$SITE; [ "$rel" = 024 ] && site=$SITE024
      [ -e "$site/vllm/_C_stable_libtorch.abi3.so" ] || { say "boundary $rel: no kernel library in $site"; continue; }
      rm -rf "/tmp/pdtrace-bnd-$rel"
      PYTHONPATH=$site timeout -k 10 "$PER_RUN" python3 scripts/live_cpu_pd.py --workdir "/tmp/pdtrace-bnd-$rel" \
        --block-size 16 --spec eagle --num-spec 3 --start-timeout 150 --load "boundary:${BOUNDARY_N:-128}" \
        > "/tmp/pdtrace-bnd-$rel.out" 2>&1 &
      pids+=($!)
    done
    # never a bare `wait` (it would wait for this script's own tee: see race)
    [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
    say "boundary done"
    for rel in ${BOUNDARY_RELEASES:-024 032}; do
      site=$SITE; [ "$rel" = 024 ] && site=$SITE024
      wd=/tmp/pdtrace-bnd-$rel
      tail -c 1500 "$wd.out"
      [ -s "$wd/merged.jsonl" ] && PYTHONPATH=$site python3 -m pdtrace merge "$wd/merged.jsonl" -o "$OUT/boundary-$rel.jsonl.zst"
      PYTHONPATH=$site python3 scripts/boundary_oracle.py "$wd" --label "vLLM $rel" --json "$wd/oracle.json"
      (cd /tmp && tar czf "$OUT/boundary-$rel.tgz" --exclude=models --exclude='*.jsonl' --exclude='*.pdshard' \
         "pdtrace-bnd-$rel" "pdtrace-bnd-$rel.out") || true
    done
    continue
  fi
  wd=/tmp/pdtrace-live-$mode
  rm -rf "$wd"
  say "live P/D + EAGLE, model runner $mode"
  case "$mode" in *v1|*v1-ring) export VLLM_USE_V2_MODEL_RUNNER=0 ;; *) unset VLLM_USE_V2_MODEL_RUNNER ;; esac
  # *-ring: every server recorded as a flight recorder (pdtrace record --ring $RING_S)
  case "$mode" in *-ring) export PDTRACE_LIVE_RECORD_ARGS="[\"--ring\",\"${RING_S:-20}\"]" ;;
    *) unset PDTRACE_LIVE_RECORD_ARGS ;; esac
  export PDTRACE_LIVE_DEVICE=cuda PDTRACE_LIVE_EXTRA_ARGS=$EXTRA PDTRACE_LIVE_KV_BUFFER=${KV_BUFFER:-cuda} \
    PDTRACE_LIVE_SPEC_EXTRA='{"attention_backend":"TRITON_ATTN"}'
  if [ "${mode#hybrid-}" != "$mode" ]; then  # one hybrid (Mamba-2 + attention) server, ngram spec decode
    timeout -k 10 "$PER_RUN" python3 scripts/live_cpu_hybrid.py --workdir "$wd"
    cp "$wd/H.jsonl" "$wd/merged.jsonl" 2>/dev/null
  else
    timeout -k 10 "$PER_RUN" python3 scripts/live_cpu_pd.py --workdir "$wd" --block-size 16 --spec eagle \
      --num-spec 3 --start-timeout 150
  fi
  say "run $mode rc=$?"
  pkill -9 -f vllm.entrypoints 2>/dev/null; pkill -9 -f "pdtrace record" 2>/dev/null; sleep 2
  if [ -s "$wd/merged.jsonl" ]; then
    python3 -c "import zstandard,sys; zstandard.ZstdCompressor(level=10).copy_stream(open(sys.argv[1],'rb'), open(sys.argv[2],'wb'))" \
      "$wd/merged.jsonl" "$OUT/merged-$mode.jsonl.zst"
  fi
  for side in P D; do  # the per-side traces, when the merge did not happen
    [ -s "$wd/merged.jsonl" ] || { [ -s "$wd/$side.jsonl" ] && cp "$wd/$side.jsonl" "$wd/$side.kept.jsonl"; }
  done
  (cd "$wd" 2>/dev/null && tar czf "$OUT/logs-$mode.tgz" --exclude=models --exclude='*.jsonl' \
     --exclude='*.pdshard' . ) || true
  grep -h "Model Runner\|model_runner\|Using .* backend\|Traceback\|Error" "$wd"/*.log 2>/dev/null | sort | uniq -c | sort -rn | head -25
done
say "done"
