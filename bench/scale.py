"""Scale benchmark (issue 22): what `check`, `info`, `merge` and `report` cost on big traces.

    python bench/scale.py [--events 1000000 [10000000 ...]] [--keep DIR] [--report] [--merge]

For each size: generates a schema-valid synthetic trace (bench/gen_trace.py, signed like
pdtrace's own writer), then runs each of these in its own process and prints its wall time,
CPU time (user + system) and peak RSS (the child's ru_maxrss):
- a bare ``orjson.loads`` loop over the file's lines, GC paused, keeping every event (what
  a whole-trace load holds: the yardstick of the goal);
- the same loop letting each event go (a lower bound no analysis reaches: parse only);
- ``pdtrace check TRACE -f json`` (streamed: the detectors' live state, not the trace);
- ``pdtrace info TRACE`` (header + footer only: goal < 1 s at any size);
- with ``--report``, ``pdtrace report`` (goal < 5 MB output, peak RSS < 1 GB);
- with ``--merge``, ``pdtrace merge P D`` of the trace split back into its P and D halves
  (written once beside it, ``-P.jsonl`` / ``-D.jsonl``; goal: peak RSS < 1 GB).
Prints ratios to the bare parse (wall and CPU: this host's wall times swing with its
neighbours; the CPU time is the steadier). Goals (issue 22): check on 10M events peak RSS
< 1 GB and time <= 1.5x the bare parse; info < 1 s. A 10M-event trace is ~2.9 GB on disk;
the keeping bare parse of it needs ~15 GB of memory (``--no-keep`` skips it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gen_trace import generate  # noqa: E402

BARE = ("import gc, orjson, sys\ngc.disable()\nloads = orjson.loads\nout = []\n"
        "with open(sys.argv[1], 'rb') as fh:\n    for line in fh:\n        out.append(loads(line))\n")
BARE_DROP = ("import gc, orjson, sys\ngc.disable()\nloads = orjson.loads\n"
             "with open(sys.argv[1], 'rb') as fh:\n    for line in fh:\n        loads(line)\n")


def measure(argv: list[str]) -> tuple[float, float, int, float]:
    """(wall seconds, peak RSS in MB, exit code, CPU seconds) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, ru.ru_maxrss / 1024, proc.returncode, ru.ru_utime + ru.ru_stime


def split(path: str) -> list[str]:
    """The trace's P and D events as two traces (what `record` writes on each host)."""
    import orjson

    from pdtrace.trace import write_trace
    out = []
    for inst in ("P", "D"):
        dst = path.replace(".jsonl", f"-{inst}.jsonl")
        out.append(dst)
        if os.path.exists(dst):
            continue
        with open(path, "rb") as fh:
            header = {**orjson.loads(fh.readline()), "origin": "record", "instances": [inst]}

            def events():
                for line in fh:
                    e = orjson.loads(line)
                    if e.get("inst") == inst:
                        e.pop("id", None)
                        yield e
            write_trace(dst, header, events())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, nargs="+", default=[1_000_000], help="trace sizes (default 1000000)")
    ap.add_argument("--keep", default=None, help="directory to keep the generated traces in")
    ap.add_argument("--report", action="store_true", help="also time `pdtrace report` and print its size")
    ap.add_argument("--merge", action="store_true", help="also time `pdtrace merge` of the trace's P and D halves")
    ap.add_argument("--no-keep", action="store_true", help="skip the keeping bare parse (it holds the whole trace)")
    a = ap.parse_args()
    py = sys.executable
    tmp = a.keep or tempfile.mkdtemp(prefix="pdtrace-scale-")
    os.makedirs(tmp, exist_ok=True)
    for n in a.events:
        path = os.path.join(tmp, f"scale-{n}.jsonl")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            generate(path, n)
            print(f"generated {path} in {time.perf_counter() - t0:.0f} s")
        mb = os.path.getsize(path) / 1e6
        print(f"\n== {n:,} events, {mb:,.0f} MB")
        bare = None
        if not a.no_keep:
            bare = measure([py, "-c", BARE, path])
            print(f"bare parse, kept  : {bare[0]:7.1f} s  cpu {bare[3]:7.1f} s  peak RSS {bare[1]:8,.0f} MB")
        drop = measure([py, "-c", BARE_DROP, path])
        print(f"bare parse, let go: {drop[0]:7.1f} s  cpu {drop[3]:7.1f} s  peak RSS {drop[1]:8,.0f} MB")
        rows = [("check", [py, "-m", "pdtrace", "check", path, "-f", "json"]),
                ("info", [py, "-m", "pdtrace", "info", path])]
        if a.report:
            rows.append(("report", [py, "-m", "pdtrace", "report", path, "-o", path + ".html"]))
        if a.merge:
            t0 = time.perf_counter()
            halves = split(path)
            print(f"split into P / D in {time.perf_counter() - t0:.0f} s (once)")
            rows.append(("merge", [py, "-m", "pdtrace", "merge", *halves, "-o", path + ".merged.jsonl"]))
        for name, argv in rows:
            wall, rss, rc, cpu = measure(argv)
            extra = ""
            if name == "check":
                if bare is not None:
                    extra += (f"  ratio to the kept parse: wall {wall / bare[0]:.2f}, cpu {cpu / bare[3]:.2f} "
                              f"(goal <= 1.5);")
                extra += (f"  to the let-go parse: wall {wall / drop[0]:.2f}, cpu {cpu / drop[3]:.2f};"
                          f"  RSS {'OK' if rss < 1000 else 'OVER'} (goal < 1 GB)")
            elif name == "info":
                extra = f"  ({'OK' if wall < 1 else 'OVER'} goal < 1 s)"
            elif name == "report" and os.path.exists(path + ".html"):
                extra = (f"  {os.path.getsize(path + '.html') / 1e6:.1f} MB (goal < 5 MB);"
                         f"  RSS {'OK' if rss < 1000 else 'OVER'} (goal < 1 GB)")
            elif name == "merge":
                extra = (f"  ratio to the let-go parse: cpu {cpu / drop[3]:.2f};"
                         f"  RSS {'OK' if rss < 1000 else 'OVER'} (goal < 1 GB)")
                if os.path.exists(path + ".merged.jsonl"):
                    os.unlink(path + ".merged.jsonl")
            print(f"{name:<18}: {wall:7.1f} s  cpu {cpu:7.1f} s  peak RSS {rss:8,.0f} MB  exit {rc}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
