"""Benchmark `pdtrace view` on a large trace: time to first screen and peak RSS.

    python bench/view.py [--size-mb 1024 | --events N] [--trace PATH] [--detect] [--zst]
                         [--in-process] [--no-check]

Generates a synthetic trace of about ``--size-mb`` with bench/gen_trace.py (bugs
injected) unless ``--trace`` is given, then runs the viewer headless (Textual
``App.run_test``) in a fresh subprocess and prints:

- first screen: seconds from creating the app to the first indexed batch on screen
  (goal < 1 s);
- index: seconds until the whole file is indexed (a trace from 64 MiB on is indexed in a
  child process, as `pdtrace view` does; ``--in-process`` indexes it in the viewer's own
  process, as before issue 39), next to the time `pdtrace check -j 2` takes over the same
  file (run after the viewer, alone; ``--no-check`` leaves it out) and their ratio (goal:
  about 1);
- peak RSS of the viewer process until the index is complete, and its ratio to the file
  size (goal < 25%); with ``--detect`` also the time and peak RSS after the detectors ran:
  up to 256 MiB in the viewer's process over a list of parsed events (that RSS grows with
  the trace), above it streamed in a child process (its peak RSS printed apart: the
  detectors' live state).
With ``--zst`` the trace is first written as a seekable .jsonl.zst (pdtrace's writer) and
the viewer indexes that in place; sizes and ratios are then of the uncompressed text.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import asyncio, json, resource, sys, time
t0 = time.perf_counter()
from pdtrace.index.trace_index import TraceIndex
from pdtrace.viewers.tui.app import PdtraceViewer

def rss_mb(who=resource.RUSAGE_SELF):
    return resource.getrusage(who).ru_maxrss / 1024

async def main(path, detect, child_bytes):
    out = {}
    t_start = time.perf_counter()
    app = PdtraceViewer(TraceIndex(path), use_default_detect=detect, batch_time=0.1, scan_child_bytes=child_bytes)
    async with app.run_test(size=(160, 45)) as pilot:
        while app.first_screen_at is None:
            await pilot.pause(0.01)
        await pilot.pause()
        out["first_screen_s"] = app.first_screen_at - t_start
        out["rss_first_screen_mb"] = rss_mb()
        while not app.indexed:
            await pilot.pause(0.05)
        out["index_s"] = time.perf_counter() - t_start
        out["events"] = len(app.index)
        out["requests"] = len(app.index.req_names)
        out["columns_mb"] = app.index.memory_bytes() / 2**20
        out["rss_indexed_mb"] = rss_mb()
        out["rss_index_child_mb"] = rss_mb(resource.RUSAGE_CHILDREN)  # the index's child process, if any
        if detect:
            while not app.findings_done:
                await pilot.pause(0.1)
            out["detect_s"] = time.perf_counter() - t_start
            out["findings"] = len(app.findings)
            out["rss_detect_mb"] = rss_mb()
            out["rss_child_mb"] = rss_mb(resource.RUSAGE_CHILDREN)  # the streamed check's process, if any
            out["note"] = app.findings_note
    out["import_s"] = t_start - t0
    out["child"] = app.scan_child
    print("RESULT " + json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024.0, help="size of the generated trace (default: %(default)s)")
    ap.add_argument("--events", type=int, help="generate this many events instead (10000000: the issue-39 trace, ~2.8 GiB)")
    ap.add_argument("--trace", help="use this trace instead of generating one")
    ap.add_argument("--detect", action="store_true", help="also wait for the detectors")
    ap.add_argument("--keep", action="store_true", help="keep the generated trace")
    ap.add_argument("--zst", action="store_true", help="view the trace written as a seekable .jsonl.zst")
    ap.add_argument("--in-process", action="store_true", help="index in the viewer's own process (no child)")
    ap.add_argument("--no-check", action="store_true", help="do not time `pdtrace check -j 2` on the trace")
    args = ap.parse_args()

    tmpdir = None
    path = args.trace
    if path is None:
        from bench.gen_trace import generate  # written alongside; ~200 bytes per event

        tmpdir = tempfile.mkdtemp(prefix="pdtrace-bench-view-")
        path = os.path.join(tmpdir, "big.jsonl")
        probe = os.path.join(tmpdir, "probe.jsonl")
        generate(probe, 20000, seed=0, inject_bugs=True)
        per_event = os.path.getsize(probe) / 20000
        os.unlink(probe)
        n = args.events or int(args.size_mb * 2**20 / per_event)
        t = time.perf_counter()
        generate(path, n, seed=0, inject_bugs=True)
        print(f"generated {n} events, {os.path.getsize(path) / 2**20:.0f} MiB in {time.perf_counter() - t:.1f}s")
    size = os.path.getsize(path)
    if args.zst:
        import shutil

        from pdtrace.tracefile.compress import open_write

        tmpdir = tmpdir or tempfile.mkdtemp(prefix="pdtrace-bench-view-")
        zpath = os.path.join(tmpdir, os.path.basename(path) + ".zst")
        with open(path, "rb") as src, open_write(zpath, compressed=True) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        print(f"compressed to {os.path.getsize(zpath) / 2**20:.0f} MiB (seekable .jsonl.zst)")
        path = zpath
    from pdtrace.tracefile.compress import is_zstd, seek_table

    if is_zstd(path):  # the viewer's sizes are those of the uncompressed text
        frames = seek_table(path)
        size = sum(d for _at, _c, d in frames) if frames else size
    try:
        env = dict(os.environ, PYTHONPATH=ROOT)
        child_bytes = 1 << 62 if args.in_process else 64 << 20
        r = subprocess.run([sys.executable, "-c", CHILD, path, "1" if args.detect else "0", str(child_bytes)],
                           capture_output=True, text=True, env=env)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
            return 1
        res = json.loads(line[7:])
        check_s = None
        if not args.no_check:
            t = time.perf_counter()
            c = subprocess.run([sys.executable, "-m", "pdtrace", "check", "-j", "2", "--lenient", path],
                               capture_output=True, text=True, env=env)
            check_s = time.perf_counter() - t
            if c.returncode not in (0, 1):
                print(c.stderr[-2000:], file=sys.stderr)
                return 1
    finally:
        if tmpdir and not args.keep:
            for f in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, f))
            os.rmdir(tmpdir)
    mb = size / 2**20
    print(f"trace: {mb:.0f} MiB, {res['events']} events, {res['requests']} requests")
    print(f"first screen: {res['first_screen_s']:.3f} s  (goal < 1 s; imports before that: {res['import_s']:.2f} s)")
    where = "in a child process" if res["child"] else "in the viewer's process"
    print(f"index complete: {res['index_s']:.2f} s, {where}  (index columns {res['columns_mb']:.0f} MiB)")
    if check_s is not None:
        print(f"`pdtrace check -j 2` on the same file: {check_s:.2f} s; index / check = "
              f"{res['index_s'] / check_s:.2f}  (goal: about 1)")
    print(f"peak RSS at first screen: {res['rss_first_screen_mb']:.0f} MiB")
    print(f"peak RSS indexed: {res['rss_indexed_mb']:.0f} MiB = {100 * res['rss_indexed_mb'] / mb:.1f}% of the file (goal < 25%)"
          + (f"; the index's child process {res['rss_index_child_mb']:.0f} MiB" if res["child"] else ""))
    if args.detect:
        print(f"detectors done: {res['detect_s']:.2f} s, {res['findings']} findings, peak RSS "
              f"{res['rss_detect_mb']:.0f} MiB = {100 * res['rss_detect_mb'] / mb:.1f}% of the file"
              + (f"; their child process {res['rss_child_mb']:.0f} MiB" if res["rss_child_mb"] else "")
              + (f"  [{res['note']}]" if res["note"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
