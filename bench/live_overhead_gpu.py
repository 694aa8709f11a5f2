#!/usr/bin/env python3
"""What `pdtrace record` costs a live P/D + EAGLE deployment on a GPU: tokens/s recorded / plain.

    python bench/live_overhead_gpu.py --device cuda [--design swap --models 1b,tiny]
        [--rounds 4] [--load-s 6] [--deadline-s 400] [--json FILE]
    python bench/live_overhead_gpu.py --device cuda --design pairs --sides 1b:plain,1b:plain,1b:rec,1b:ring60
    python bench/live_overhead_gpu.py --device cpu --models tiny --rounds 1   # a dry run here

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
  * --design swap (default): per model three pairs, A, B and C, in two phases with every server restarted
    between them: A plain then recorded, B recorded then plain, C plain twice (the A/A control); the
    ratios are each pair's recorded over its own plain, so a pair's own speed cancels (two plain pairs
    were measured 27 % apart on an H200, persistently), and A's and B's geometric mean cancels a drift
    between the phases. --design pairs: the sides given, each in one state (bench/overhead_stats.py);
  * the verdict ("recorded/plain >= 0.97") is given only when the control's spread (its farthest ratio
    from 1) is below the 3 % it must resolve; else the table says "unresolved" and the ratios are only
    information.

Exit code: 0 verdict met, 1 verdict missed, 3 unresolved (the control too wide or absent), 2 cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))

BLOCK = 16  # the GPU runs' block size (scripts/gpu_run.sh); vLLM's CPU attention wants multiples of 32


def _rec_args(kind: str) -> list[str] | None:
    return None if kind == "plain" else ([] if kind == "rec" else ["--ring", kind[4:]])


def parse_sides(text: str) -> list[dict]:
    """--design pairs: MODEL:KIND,... -> one side each, in one state for the whole run."""
    out, seen = [], {}
    for item in text.split(","):
        model, _, kind = item.strip().partition(":")
        if model not in ("tiny", "1b") or not (kind in ("plain", "rec") or
                                               (kind.startswith("ring") and kind[4:].isdigit())):
            raise SystemExit(f"live_overhead_gpu: bad side {item!r} (MODEL:KIND, MODEL tiny|1b, KIND plain|rec|ringN)")
        seen[(model, kind)] = seen.get((model, kind), 0) + 1
        name = f"{model}-{kind}" + (chr(ord("a") + seen[(model, kind)] - 1) if kind == "plain" else "")
        out.append({"name": name, "model": model, "kinds": [kind]})
    return out


def swap_sides(models: list[str], rec: str) -> list[dict]:
    """--design swap: per model slots A (plain, then recorded), B (recorded, then plain), C (plain twice)."""
    for m in models:
        if m not in ("tiny", "1b"):
            raise SystemExit(f"live_overhead_gpu: bad model {m!r} (tiny|1b)")
    return [{"name": f"{m}-{slot}", "model": m, "slot": slot, "kinds": kinds} for m in models
            for slot, kinds in (("A", ["plain", rec]), ("B", [rec, "plain"]), ("C", ["plain", "plain"]))]


def core_sets(n: int) -> tuple[list[list[int]], list[int]]:
    """Disjoint CPU sets for n pairs and the bench's own; with fewer cores than pairs + 1 (a CPU dry
    run) every pair gets every core."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 * n + 1:
        return [cpus] * n, cpus
    own, rest = cpus[-1:], cpus[:-1]
    per = len(rest) // n
    return [rest[i * per:(i + 1) * per] for i in range(n)], own


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

    c0 = LS.tree_cpu_seconds(pair["servers"])
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        got = list(pool.map(one, reqs))
    wall = time.monotonic() - t0
    time.sleep(0.3)  # the last transfer notifications and recorder writes land in this load
    cpu = LS.tree_cpu_seconds(pair["servers"]) - c0
    toks = sum(n for n, _ in got)
    return {"side": pair["name"], "kind": pair["kind"], "tokens": toks, "wall_s": round(wall, 3),
            "tok_s": round(toks / wall, 2), "cpu_s_per_tok": round(cpu / toks, 6) if toks else None,
            "lat_per_tok": [round(s / n, 6) for n, s in got if n]}


def start_all(sides: list[dict], phase: int, models: dict, a: argparse.Namespace, wd: Path) -> list[dict]:
    sets, own = core_sets(len(sides))
    base_extra = list(L.EXTRA_ARGS)
    pairs = []
    for side, cores in zip(sides, sets):
        kind = side["kinds"][min(phase, len(side["kinds"]) - 1)]
        os.sched_setaffinity(0, cores)  # inherited by every process of the pair; the same cores in every phase
        try:
            LS.RECORD_ARGS = _rec_args(kind) or []
            LS.EXTRA_ARGS = base_extra + ["--max-num-seqs", str(a.max_num_seqs)] + (
                # a fixed KV size: no memory profiling, whose free-memory deltas the other pairs'
                # concurrent start would disturb (vllm/v1/worker/gpu_worker.py determine_available_memory)
                ["--gpu-memory-utilization", str(a.gpu_mem), "--kv-cache-memory-bytes", str(2 << 30)]
                if a.device == "cuda" else []) + (
                ["--load-format", "dummy"] if side["model"] == "1b" else [])
            sd = wd / f"{side['name']}-p{phase}"
            sd.mkdir(parents=True, exist_ok=True)
            servers = L.start_pair(sd, models[side["model"]], "eagle", 3, BLOCK, _rec_args(kind) is not None)
        finally:
            os.sched_setaffinity(0, own)
            LS.EXTRA_ARGS = base_extra
        pairs.append({**side, "kind": kind, "servers": servers, "cores": f"{cores[0]}-{cores[-1]}"})
    return pairs


def stop_all(pairs: list[dict], events: dict) -> None:
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
                    events[f"{p['name']}-{p['kind']}/{k}"] = sum(1 for _ in f)


def run_phase(phase: int, sides: list[dict], models: dict, a: argparse.Namespace, wd: Path, until: float,
              size: dict, st: dict, say) -> list[dict]:
    """Start every pair in this phase's state, warm each up, then rounds (each pair alone per load, the order
    rotated and reversed every other round) until ``until`` (monotonic) leaves less than a round; stop them."""
    pairs = start_all(sides, phase, models, a, wd)
    loads: list[dict] = []
    try:
        deadline = time.monotonic() + a.start_timeout
        for p in list(pairs):  # a pair that cannot start is dropped and said, the others go on
            try:
                L.wait_ready(p["servers"], max(1.0, deadline - time.monotonic()))
            except RuntimeError as exc:
                st["failed"][f"{p['name']} phase {phase}"] = str(exc)[-1500:]
                say(f"{p['name']} ({p['kind']}) did not start, dropped: {str(exc)[-600:]}")
                for srv, _ in p["servers"].values():
                    srv.stop(timeout=10.0)
                pairs.remove(p)
        say(f"phase {phase} ready: " + ", ".join(f"{p['name']} {p['kind']} on cores {p['cores']}" for p in pairs))
        for p in pairs:  # warm-up, not measured; the first pair of each model sizes its loads once
            w = serve(p, plan(2 * a.concurrency, 500), a.concurrency)
            if p["model"] not in size:
                per_req = w["wall_s"] / (2 * a.concurrency)
                size[p["model"]] = max(a.concurrency, int(a.load_s / per_req) // a.concurrency * a.concurrency)
            say(f"warm-up {p['name']} {p['kind']}: {w['tok_s']} tok/s")
        one_round = None
        for i in range(a.rounds if pairs else 0):
            left = until - time.monotonic()
            if one_round is not None and left < one_round + 35:  # 35 s: stopping the servers
                say(f"phase {phase}: stopping after {i} rounds, {left:.0f}s of its budget left")
                break
            t_r = time.monotonic()
            order = pairs[i % len(pairs):] + pairs[:i % len(pairs)]
            for p in (order[::-1] if i % 2 else order):
                time.sleep(1.0)
                r = serve(p, plan(size[p["model"]], 1000 + 100 * i), a.concurrency)
                loads.append({**r, "phase": phase, "round": st["rounds"]})
                say(f"phase {phase} round {i + 1} {p['name']} {p['kind']}: {r['tokens']} tok in {r['wall_s']} s "
                    f"= {r['tok_s']} tok/s")
            st["rounds"] += 1
            one_round = time.monotonic() - t_r
    finally:
        stop_all(pairs, st["events"])
    return loads


def analyse(res: dict, loads: list[dict], sides: list[dict], design: str) -> int:
    rc = 0
    for model in dict.fromkeys(s["model"] for s in sides):
        ms = [s for s in sides if s["model"] == model]
        ratios = {}
        for key in ("tok_s", "cpu_s_per_tok"):
            if design == "swap":
                ratios[key] = S.swap_ratios(loads, key, {s["slot"]: s["name"] for s in ms})
            else:
                ratios[key] = S.pair_ratios(loads, key, [s["name"] for s in ms if s["kinds"] == ["plain"]],
                                            [s["name"] for s in ms if s["kinds"] != ["plain"]])
        v, spread = S.verdict(ratios["tok_s"])
        res["models"][model] = {"tok_s": ratios["tok_s"], "cpu_per_tok": ratios["cpu_s_per_tok"],
                                "control_spread": spread, "verdict": v,
                                "sides": [x for s in ms for k in dict.fromkeys(s["kinds"])
                                          if (x := S.side_stats(loads, s["name"], k))]}
        rc = max(rc, {"met": 0, "missed": 1, "unresolved": 3}[v])
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Needs vLLM and nixl (scripts/install.sh --live; on this project's GPU machines scripts/gpu_run.sh "
               "carries them) and, with --device cuda, one GPU shared by every server and about 2 CPU cores per pair "
               "(3 pairs per model with --design swap). Exit: 0 met, 1 missed, 3 unresolved, 2 cannot run.")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where the servers run (cpu: a dry run of the whole procedure; its figures mean nothing)")
    ap.add_argument("--design", choices=("swap", "pairs"), default="swap",
                    help="swap: each pair plain and recorded across a restart (A/B), an A/A pair as control; "
                         "pairs: the --sides given, each in one state")
    ap.add_argument("--models", default="1b,tiny", help="--design swap: the model sizes (tiny, 1b)")
    ap.add_argument("--rec", default="rec", help="--design swap: the recorded state, rec or ringN")
    ap.add_argument("--sides", default="1b:plain,1b:plain,1b:rec,tiny:plain,tiny:plain,tiny:rec",
                    help="--design pairs: comma-separated MODEL:KIND (MODEL tiny|1b; KIND plain|rec|ringN); two "
                         "plain sides of a model give its A/A control")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per phase at most")
    ap.add_argument("--load-s", type=float, default=6.0, help="about how long one load lasts")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight during a load")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="each server's --max-num-seqs")
    ap.add_argument("--gpu-mem", type=float, default=0.07, help="--gpu-memory-utilization of each server")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for every pair of a phase to start")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="the whole run's budget in seconds (0: none): each phase stops starting rounds at its "
                         "share of it")
    ap.add_argument("--json", metavar="FILE", help="also write every load and the verdict as JSON")
    ap.add_argument("--workdir", help="keep models and server logs here (default: a temporary directory)")
    a = ap.parse_args(argv)
    os.environ["PDTRACE_LIVE_DEVICE"] = a.device
    global L, LS, S, pd_proxy, BLOCK
    BLOCK = 16 if a.device == "cuda" else 32
    import live_cpu_pd as L
    import live_servers as LS
    import make_tiny_models
    import overhead_stats as S
    import pd_proxy

    t_start = time.monotonic()
    if a.rec != "rec" and not (a.rec.startswith("ring") and a.rec[4:].isdigit()):
        raise SystemExit(f"live_overhead_gpu: bad --rec {a.rec!r} (rec or ringN)")
    sides = swap_sides(a.models.split(","), a.rec) if a.design == "swap" else parse_sides(a.sides)
    why = L.preflight()
    if why:
        print(f"live_overhead_gpu: cannot run: {why}", file=sys.stderr)
        return 2
    say = lambda m: print(f"live_overhead_gpu +{time.monotonic() - t_start:.0f}s: {m}", file=sys.stderr, flush=True)  # noqa: E731
    runner = "cpu" if a.device == "cpu" else ("v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2")
    phases = 2 if a.design == "swap" else 1
    budget = a.deadline_s or 1e9
    st: dict = {"failed": {}, "events": {}, "rounds": 0}
    loads: list[dict] = []
    size: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="pdtrace-overhead-") as td:
        wd = Path(a.workdir or td)
        models = {}
        if any(s["model"] == "tiny" for s in sides):
            models["tiny"] = make_tiny_models.build(wd / "models", eagle=True)
        if any(s["model"] == "1b" for s in sides):
            models["1b"] = make_tiny_models.build_1b(wd / "models", eagle=True)
        for ph in range(phases):
            loads += run_phase(ph, sides, models, a, wd, t_start + budget * (ph + 1) / phases, size, st, say)
    res = {"device": a.device, "runner": runner, "design": a.design, "max_num_seqs": a.max_num_seqs,
           "concurrency": a.concurrency, "rounds_done": st["rounds"], "events": st["events"],
           "failed_to_start": st["failed"], "loads": loads, "models": {}}
    if a.device == "cuda":
        try:
            import torch

            res["device"] = torch.cuda.get_device_name(0)
        except Exception:
            pass
    rc = analyse(res, loads, sides, a.design)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(S.table(res))
    print(f"events recorded per server: {json.dumps(st['events'])}")
    for name, why in st["failed"].items():
        print(f"{name}: did not start: {why.splitlines()[-1] if why else ''}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
