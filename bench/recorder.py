"""Recorder benchmark: cost on the caller's thread, writer throughput, bounded memory.

    python bench/recorder.py [--events 200000]

Prints:
- median / p99 ns per event on the caller's thread (goal <= 2000 ns), measured in batches of
  100 calls with a realistic sched.alloc payload while the writer thread runs, in the three
  forms: ``put`` with a fresh dict literal per call (how every per-step hook records, the
  scheduler's and the worker's), ``put`` reusing one dict (the floor), and ``emit`` with
  keywords (the convenience form, left to rare events: proc / hooks status, errors, NIXL
  per-request events); the goal is judged on the hook form;
- events/s the writer thread sustains to a real shard file;
- with a queue bound of 50k and a sink slower than the producer, the queue never exceeds
  the bound, drops are counted, and peak traced memory stays bounded;
- ``pdtrace record``'s merge of a recording's shards into one trace (``shards.finalize_session``)
  on --merge-events events in 4 shards (default 4M): wall time and the merging process's
  peak RSS (goal < 300 MB, independent of the number of events: compare --merge-events 1000000).
"""

from __future__ import annotations

import argparse
import marshal
import os
import resource
import subprocess
import statistics
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pdtrace.record.recorder import Recorder  # noqa: E402


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
        b, nb = p["block_ids"], p["new_block_ids"]
        if api == "put (hook form)":
            put = rec.put
            for i in range(n // batch):
                t0 = time.perf_counter_ns()
                for _ in range(batch):
                    put("sched.alloc", "req-1", i, {
                        "ok": True, "block_ids": b, "new_block_ids": nb, "num_computed_tokens": 32,
                        "num_new_tokens": 4, "num_lookahead_tokens": 3, "sched_lookahead_tokens": 3,
                        "num_external_computed_tokens": 0, "num_new_computed_tokens": 0,
                        "delay_cache_blocks": False, "prompt_len": 32})
                samples.append((time.perf_counter_ns() - t0) / batch)
        elif api == "put (one dict)":
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


def write_shards(d: str, n: int, shards: int = 4, per_frame: int = 1000) -> int:
    """``shards`` shard files of n events in total, written frame by frame the way a recorder's
    writer thread does (``frames.frame_head`` + marshal payload), times interleaved across
    shards and, inside each frame, two threads' events slightly out of order."""
    import zlib

    from pdtrace.record.frames import SHARD_SUFFIX, frame_head

    size = 0
    per_shard = n // shards
    for k in range(shards):
        path = os.path.join(d, f"{1000 + k}{SHARD_SUFFIX}")
        meta = (1000 + k, "worker" if k else "engine-core", "D" if k % 2 else "P", None, 1_700_000_000_000_000_000)
        with open(path, "wb") as fh:
            for start in range(0, per_shard, per_frame):
                items = []
                for i in range(start, min(start + per_frame, per_shard)):
                    t = 10_000 + (i - (i % 2) * 3) * shards * 1000 + k  # odd events 3 us late (another thread)
                    items.append(("sched.alloc", t, f"req-{i % 512}", i // 64, payload(i)))
                body = marshal.dumps((meta, items), 4)
                fh.write(frame_head(len(body), len(items), zlib.crc32(body)) + body)
        size += os.path.getsize(path)
    return size


def merge_memory(n: int) -> tuple[float, float, int]:
    """Peak RSS (MB) and wall time of finalize_session on n events, in a fresh process."""
    with tempfile.TemporaryDirectory() as d:
        shard_dir = os.path.join(d, "shards")
        os.mkdir(shard_dir)
        size = write_shards(shard_dir, n)
        code = ("import resource, sys, time; from pdtrace.record.shards import finalize_session; t=time.perf_counter(); "
                f"f, p = finalize_session({shard_dir!r}, {os.path.join(d, 't.jsonl')!r}, cmd=['bench'], "
                "redacted=True, exit_code=0); "
                "print(f['events'], len(p), time.perf_counter() - t, "
                "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        events, problems, dt, maxrss_kb = out.stdout.split()
        assert int(events) == n - n % 4 and problems == "0", out.stdout
    return int(maxrss_kb) / 1024, float(dt), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--merge-events", type=int, default=4_000_000)
    ap.add_argument("--only-merge", action="store_true", help="measure the merge only")
    a = ap.parse_args()
    if a.merge_events:
        rss, dt, size = merge_memory(a.merge_events)
        print(f"merge of {a.merge_events:,} events in 4 shards ({size / 1e6:.0f} MB of frames): {dt:.1f} s, "
              f"peak RSS {rss:.0f} MB (goal < 300 MB: {rss / 300:.2f} of budget)")
    if a.only_merge:
        return
    for api in ("put (hook form)", "put (one dict)", "emit (keywords)"):
        med, p99 = caller_cost(a.events, api)
        goal = f" (goal <= 2000 ns: {med / 2000:.2f} of budget)" if api == "put (hook form)" else ""
        print(f"{api:<16} on the caller's thread (11-field sched.alloc payload): median {med:.0f} ns, "
              f"p99 {p99:.0f} ns per event{goal}")
    eps = writer_throughput(a.events)
    print(f"writer thread sustains {eps:,.0f} events/s to disk")
    bound = 5_000
    peak_q, dropped, peak = bounded_memory(a.events, bound)
    print(f"producer faster than disk: queue peak {peak_q} <= bound {bound}: {peak_q <= bound}; "
          f"{dropped} events dropped and counted; peak traced memory {peak / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
