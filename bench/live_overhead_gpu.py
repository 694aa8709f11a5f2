#!/usr/bin/env python3
"""What `pdtrace record` costs a live P/D + EAGLE deployment on a GPU: tokens/s recorded / plain.

    python bench/live_overhead_gpu.py --device cuda [--sides 1b:plain,1b:plain,1b:rec,...]
        [--rounds 4] [--load-s 8] [--deadline-s 270] [--json FILE]
    python bench/live_overhead_gpu.py --device cpu --sides tiny:plain,tiny:rec --rounds 1   # a dry run here

(On a GPU machine of this project scripts/gpu_run.sh runs it: `bash scripts/gpu_run.sh overhead`.)

Why not bench/live_overhead.py: that one measures CPU seconds per token on this project's 2-core hosts,
where wall-clock throughput decides nothing. A GPU machine has 16 cores and a GPU on which a vLLM step
is short, so the hooks' per-step Python cost weighs most there, and tokens/s can be measured:

  * every side is its own P/D pair (kv_producer P + kv_consumer D, NixlConnector over UCX with the KV
    in GPU memory, EAGLE with 3 speculative tokens on both, model runner V2 unless
    VLLM_USE_V2_MODEL_RUNNER=0), the same commands as scripts/live_cpu_pd.py; all pairs are up at
    once, each pinned to its own CPU cores (the affinity its processes inherit), all sharing the GPU
    at a fixed memory fraction;
  * a side is MODEL:KIND, MODEL `tiny` (the 2-layer test model: Python-bound steps, the worst case)
    or `1b` (a Llama-shaped ~1.2B model, --load-format dummy: a step a user would see), KIND `plain`,
    `rec` (every server under `pdtrace record`, default settings) or `ringN` (`pdtrace record --ring
    N`: the flight recorder, whose worker-side online checks are on by default);
  * after a warm-up load per pair, ROUNDS rounds; in each, every pair serves the same load ALONE (the
    others idle: the GPU is not shared while measuring), the order rotated and reversed every other
    round (ABBA), so drift weighs on every side; a load is sized from the warm-up to last about
    --load-s seconds;
  * per load: output tokens/s, per-request latency per output token (median, p99 over the side's
    requests), CPU seconds per output token of every process of the pair;
  * per model, per round: each side's tokens/s over the mean of that round's plain sides; two plain
    sides give the A/A control (plain / plain). The verdict ("recorded/plain >= 0.97") is given only
    when the control's spread (its farthest ratio from 1) is below the 3 % it must resolve; else
    the table says "unresolved" and the ratios are only information.

Exit code: 0 verdict met, 1 verdict missed, 3 unresolved (the control too wide or absent), 2 cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

GOAL = 0.97
RESOLVE = 0.03  # the control must be tighter than the effect it resolves
BLOCK = 16  # the GPU runs' block size (scripts/gpu_run.sh); vLLM's CPU attention wants multiples of 32


def parse_sides(text: str) -> list[dict]:
    out, seen = [], {}
    for item in text.split(","):
        model, _, kind = item.strip().partition(":")
        if model not in ("tiny", "1b") or not (kind in ("plain", "rec") or
                                               (kind.startswith("ring") and kind[4:].isdigit())):
            raise SystemExit(f"live_overhead_gpu: bad side {item!r} (MODEL:KIND, MODEL tiny|1b, KIND plain|rec|ringN)")
        seen[(model, kind)] = seen.get((model, kind), 0) + 1
        name = f"{model}-{kind}" + (chr(ord("a") + seen[(model, kind)] - 1) if kind == "plain" else "")
        rec = None if kind == "plain" else ([] if kind == "rec" else ["--ring", kind[4:]])
        out.append({"name": name, "model": model, "kind": kind, "record_args": rec})
    return out


def core_sets(n: int) -> tuple[list[list[int]], list[int]]:
    """Disjoint CPU sets for n pairs and the bench's own; with fewer cores than pairs + 1 (a CPU dry
    run) every pair gets every core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 * n + 1:
        return [cpus] * n, cpus
    own, rest = cpus[-1:], cpus[:-1]
    per = len(rest) // n
    return [rest[i * per:(i + 1) * per] for i in range(n)], own


def proc_cpu(servers: dict) -> float:
    import psutil

    total = 0.0
    for srv, _ in servers.values():
        for p in L._proc_tree(srv.proc.pid):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def plan(n: int, seed0: int) -> list[dict]:
    """n requests, prompts of 2-4 blocks, half of them block-aligned, 48 output tokens each."""
    return [{"len": (2 + i % 3) * BLOCK + (0 if i % 2 else 9), "max_tokens": 48, "seed": seed0 + i} for i in range(n)]


def serve(pair: dict, reqs: list[dict], concurrency: int) -> dict:
    """One load through P then D (pd_proxy's disaggregated_completion, from a pool of senders)."""
    p_url = f"http://127.0.0.1:{pair['servers']['P'][1]}"
    d_url = f"http://127.0.0.1:{pair['servers']['D'][1]}"

    def one(r: dict) -> tuple[int, float]:
        t = time.monotonic()
        resp = pd_proxy.disaggregated_completion(L.completion_body(r), p_url, d_url)
        return resp["usage"]["completion_tokens"], time.monotonic() - t

    c0 = proc_cpu(pair["servers"])
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        got = list(pool.map(one, reqs))
    wall = time.monotonic() - t0
    time.sleep(0.3)  # the last transfer notifications and recorder writes land in this load
    cpu = proc_cpu(pair["servers"]) - c0
    toks = sum(n for n, _ in got)
    return {"side": pair["name"], "tokens": toks, "wall_s": round(wall, 3), "tok_s": round(toks / wall, 2),
            "cpu_s_per_tok": round(cpu / toks, 6) if toks else None,
            "lat_per_tok": [round(s / n, 6) for n, s in got if n]}


def start_all(sides: list[dict], models: dict, a: argparse.Namespace, wd: Path) -> list[dict]:
    sets, own = core_sets(len(sides))
    base_extra = list(L.EXTRA_ARGS)
    pairs = []
    for side, cores in zip(sides, sets):
        os.sched_setaffinity(0, cores)  # inherited by every process of the pair
        try:
            LS.RECORD_ARGS = side["record_args"] or []
            LS.EXTRA_ARGS = base_extra + ["--max-num-seqs", str(a.max_num_seqs)] + (
                # a fixed KV size: no memory profiling, whose free-memory deltas the other pairs'
                # concurrent start would disturb (vllm/v1/worker/gpu_worker.py determine_available_memory)
                ["--gpu-memory-utilization", str(a.gpu_mem), "--kv-cache-memory-bytes", str(2 << 30)]
                if a.device == "cuda" else []) + (
                ["--load-format", "dummy"] if side["model"] == "1b" else [])
            sd = wd / side["name"]
            sd.mkdir(parents=True, exist_ok=True)
            servers = L.start_pair(sd, models[side["model"]], "eagle", 3, BLOCK, side["record_args"] is not None)
        finally:
            os.sched_setaffinity(0, own)
            LS.EXTRA_ARGS = base_extra
        pairs.append({**side, "servers": servers, "cores": f"{cores[0]}-{cores[-1]}"})
    return pairs


def ratios(rounds: list[list[dict]], sides: list[dict], key: str, model: str) -> dict:
    """Per side of ``model``: per round, its value over the mean of that round's plain sides."""
    plains = [s["name"] for s in sides if s["model"] == model and s["kind"] == "plain"]
    out: dict[str, list[float]] = {}
    for rnd in rounds:
        by = {r["side"]: r[key] for r in rnd}
        if not plains or not all(by.get(p) for p in plains):
            continue
        ref = statistics.mean(by[p] for p in plains)
        for s in sides:
            if s["model"] == model and s["kind"] != "plain" and by.get(s["name"]):
                out.setdefault(s["name"], []).append(by[s["name"]] / ref)
        if len(plains) >= 2:
            out.setdefault("control", []).append(by[plains[1]] / by[plains[0]])
    return {k: {"ratios": [round(x, 4) for x in v], "median": round(statistics.median(v), 4),
                "min": round(min(v), 4), "max": round(max(v), 4)} for k, v in out.items()}


def verdict(tok: dict) -> tuple[str, float | None]:
    ctl = tok.get("control")
    spread = max(abs(1 - x) for x in ctl["ratios"]) if ctl else None
    recs = {k: v for k, v in tok.items() if k != "control"}
    if spread is None or spread >= RESOLVE or not recs:
        return "unresolved", spread
    return ("met" if all(v["median"] >= GOAL for v in recs.values()) else "missed"), spread


def side_stats(rounds: list[list[dict]], name: str) -> dict:
    lat = sorted(x for rnd in rounds for r in rnd if r["side"] == name for x in r["lat_per_tok"])
    cpu = [r["cpu_s_per_tok"] for rnd in rounds for r in rnd if r["side"] == name and r["cpu_s_per_tok"]]
    tps = [r["tok_s"] for rnd in rounds for r in rnd if r["side"] == name]
    if not lat:
        return {}
    return {"tok_s_median": round(statistics.median(tps), 1), "lat_per_tok_ms_median": round(1e3 * statistics.median(lat), 3),
            "lat_per_tok_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
            "cpu_ms_per_tok_median": round(1e3 * statistics.median(cpu), 3) if cpu else None}


def table(res: dict) -> str:
    lines = [f"live P/D + EAGLE, {res['device']}, model runner {res['runner']}, {res['rounds_done']} rounds "
             f"(each side alone per load, ABBA order), max-num-seqs {res['max_num_seqs']}",
             "| model | side | tok/s / plain (median, min-max) | A/A control spread | verdict | tok/s | "
             "ms/token median | p99 | CPU ms/token |", "|---|---|---|---|---|---|---|---|---|"]
    for model, m in res["models"].items():
        for name, st in m["sides"].items():
            r = m["tok_s"].get(name)
            rr = f"{r['median']} ({r['min']}-{r['max']})" if r else ("reference" if "plain" in name else "-")
            sp = "-" if m["control_spread"] is None else f"{100 * m['control_spread']:.1f} %"
            lines.append(f"| {model} | {name} | {rr} | {sp} | {m['verdict'] if r else ''} | {st.get('tok_s_median')} | "
                         f"{st.get('lat_per_tok_ms_median')} | {st.get('lat_per_tok_ms_p99')} | "
                         f"{st.get('cpu_ms_per_tok_median')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sides", default="1b:plain,1b:plain,1b:rec,tiny:plain,tiny:plain,tiny:rec",
                    help="comma-separated MODEL:KIND (MODEL tiny|1b; KIND plain|rec|ringN); two plain sides "
                         "of a model give its A/A control")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--load-s", type=float, default=4.0, help="about how long one load lasts")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=0.07, help="--gpu-memory-utilization of each server")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="stop starting rounds when fewer than a round's seconds are left of this budget")
    ap.add_argument("--json", metavar="FILE", help="also write every load and the verdict as JSON")
    ap.add_argument("--workdir", help="keep models and server logs here (default: a temporary directory)")
    a = ap.parse_args(argv)
    os.environ["PDTRACE_LIVE_DEVICE"] = a.device
    global L, LS, pd_proxy, BLOCK
    BLOCK = 16 if a.device == "cuda" else 32
    import live_cpu_pd as L
    import live_servers as LS
    import pd_proxy
    import make_tiny_models

    t_start = time.monotonic()
    sides = parse_sides(a.sides)
    why = L.preflight()
    if why:
        print(f"live_overhead_gpu: cannot run: {why}", file=sys.stderr)
        return 2
    say = lambda m: print(f"live_overhead_gpu +{time.monotonic() - t_start:.0f}s: {m}", file=sys.stderr, flush=True)  # noqa: E731
    runner = "cpu" if a.device == "cpu" else ("v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2")
    rounds: list[list[dict]] = []
    with tempfile.TemporaryDirectory(prefix="pdtrace-overhead-") as td:
        wd = Path(a.workdir or td)
        models = {}
        if any(s["model"] == "tiny" for s in sides):
            models["tiny"] = make_tiny_models.build(wd / "models", eagle=True)
        if any(s["model"] == "1b" for s in sides):
            models["1b"] = make_tiny_models.build_1b(wd / "models", eagle=True)
        pairs = start_all(sides, models, a, wd)
        events: dict[str, int] = {}
        failed: dict[str, str] = {}
        try:
            deadline = time.monotonic() + a.start_timeout
            for p in list(pairs):  # a pair that cannot start is dropped and said, the others go on
                try:
                    L.wait_ready(p["servers"], max(1.0, deadline - time.monotonic()))
                except RuntimeError as exc:
                    failed[p["name"]] = str(exc)[-1500:]
                    say(f"{p['name']} did not start, dropped: {str(exc)[-600:]}")
                    for srv, _ in p["servers"].values():
                        srv.stop(timeout=10.0)
                    pairs.remove(p)
            sides = [s for s in sides if s["name"] not in failed]
            say("ready: " + ", ".join(f"{p['name']} on cores {p['cores']}" for p in pairs))
            size: dict[str, int] = {}
            for p in pairs:  # warm-up, not measured; the first pair of each model sizes its loads
                w = serve(p, plan(2 * a.concurrency, 500), a.concurrency)
                if p["model"] not in size:
                    per_req = w["wall_s"] / (2 * a.concurrency)
                    size[p["model"]] = max(a.concurrency, int(a.load_s / per_req) // a.concurrency * a.concurrency)
                say(f"warm-up {p['name']}: {w['tok_s']} tok/s")
            say(f"loads: {size} requests per model")
            one_round = None
            for i in range(a.rounds):
                left = a.deadline_s - (time.monotonic() - t_start) if a.deadline_s else None
                if left is not None and one_round is not None and left < one_round + 35:  # 35 s: stopping
                    say(f"stopping after {i} rounds: {left:.0f}s of the budget left")
                    break
                t_r = time.monotonic()
                order = pairs[i % len(pairs):] + pairs[:i % len(pairs)]
                order = order[::-1] if i % 2 else order
                rnd = []
                for p in order:
                    time.sleep(1.0)
                    r = serve(p, plan(size[p["model"]], 1000 + 100 * i), a.concurrency)
                    rnd.append(r)
                    say(f"round {i + 1} {p['name']}: {r['tokens']} tok in {r['wall_s']} s = {r['tok_s']} tok/s")
                rounds.append(rnd)
                one_round = time.monotonic() - t_r
        finally:
            stops = []
            for p in pairs:
                for srv, _ in p["servers"].values():
                    th = threading.Thread(target=srv.stop, kwargs={"timeout": 40.0})
                    th.start()
                    stops.append(th)
            for th in stops:
                th.join()
            for p in pairs:
                for k, (srv, _) in p["servers"].items():
                    if srv.trace is not None and srv.trace.exists():
                        with open(srv.trace, "rb") as f:
                            events[f"{p['name']}/{k}"] = sum(1 for _ in f)
    res = {"device": a.device, "runner": runner,
           "max_num_seqs": a.max_num_seqs, "concurrency": a.concurrency, "rounds_done": len(rounds),
           "events": events, "failed_to_start": failed, "loads": rounds, "models": {}}
    try:
        import torch

        if a.device == "cuda":
            res["device"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    rc = 0
    for model in dict.fromkeys(s["model"] for s in sides):
        tok = ratios(rounds, sides, "tok_s", model)
        v, spread = verdict(tok)
        res["models"][model] = {"tok_s": tok, "cpu_per_tok": ratios(rounds, sides, "cpu_s_per_tok", model),
                                "control_spread": spread, "verdict": v,
                                "sides": {s["name"]: side_stats(rounds, s["name"]) for s in sides if s["model"] == model}}
        rc = max(rc, {"met": 0, "missed": 1, "unresolved": 3}[v])
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"events recorded per server: {json.dumps(events)}")
    for name, why in failed.items():
        print(f"{name}: did not start: {why.splitlines()[-1] if why else ''}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
