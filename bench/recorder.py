"""Recorder benchmark: cost on the caller's thread, writer throughput, bounded memory.

    python bench/recorder.py [--events 200000]

Prints:
- median / p99 ns per Recorder.emit() on the caller's thread (goal <= 2000 ns), measured in
  batches of 100 calls with a realistic sched.alloc payload while the writer thread runs;
- events/s the writer thread sustains to a real shard file;
- with a queue bound of 50k and a sink slower than the producer, the queue never exceeds
  the bound, drops are counted, and peak traced memory stays bounded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pdtrace.recorder import Recorder  # noqa: E402


def payload(i: int) -> dict:
    return dict(ok=True, block_ids=[[i, i + 1, i + 2]], new_block_ids=[[i + 2]], num_computed_tokens=32,
                num_new_tokens=4, num_lookahead_tokens=3, sched_lookahead_tokens=3,
                num_external_computed_tokens=0, num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=32)


def caller_cost(n: int, api: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder.to_shard_dir(d, flush_interval=0.05)
        samples = []
        batch = 100
        p = payload(1)
        if api == "put":
            put = rec.put
            for i in range(n // batch):
                t0 = time.perf_counter_ns()
                for _ in range(batch):
                    put("sched.alloc", "req-1", i, p)
                samples.append((time.perf_counter_ns() - t0) / batch)
        else:
            emit = rec.emit
            for i in range(n // batch):
                t0 = time.perf_counter_ns()
                for _ in range(batch):
                    emit("sched.alloc", req="req-1", step=i, **p)
                samples.append((time.perf_counter_ns() - t0) / batch)
        rec.close()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def writer_throughput(n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder.to_shard_dir(d, flush_interval=3600, threaded=True)
        p = payload(1)
        for i in range(n):
            rec.emit("sched.alloc", req="req-1", step=i, **p)
        t0 = time.perf_counter()
        rec.flush()
        dt = time.perf_counter() - t0
        size = os.path.getsize(rec.shard_path)
        rec.close()
    print(f"  writer: {n} events, {size / 1e6:.1f} MB in {dt:.3f} s")
    return n / dt


def bounded_memory(n: int, bound: int) -> tuple[int, int, int]:
    slow_written = []

    def slow_sink(batch):
        time.sleep(0.05)  # a disk slower than the producer
        slow_written.append(len(batch))

    tracemalloc.start()
    rec = Recorder(slow_sink, max_queue=bound, flush_interval=0.01)
    p = payload(2)
    peak_q = 0
    for i in range(n):
        rec.emit("sched.alloc", req="r", step=i, **p)
        if i % 1000 == 0:
            peak_q = max(peak_q, len(rec._q))
    rec.close()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak_q, rec.dropped, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    a = ap.parse_args()
    for api in ("put", "emit"):
        med, p99 = caller_cost(a.events, api)
        print(f"{api}() on the caller's thread (11-field sched.alloc payload): median {med:.0f} ns, p99 {p99:.0f} ns "
              f"per event (goal <= 2000 ns: {med / 2000:.2f} of budget)")
    eps = writer_throughput(a.events)
    print(f"writer thread sustains {eps:,.0f} events/s to disk")
    bound = 5_000
    peak_q, dropped, peak = bounded_memory(a.events, bound)
    print(f"producer faster than disk: queue peak {peak_q} <= bound {bound}: {peak_q <= bound}; "
          f"{dropped} events dropped and counted; peak traced memory {peak / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
