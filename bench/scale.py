"""Scale benchmark (issue 22): what `check`, `info`, `merge` and `report` cost on big traces.

    python bench/scale.py [--events 1000000 [10000000 ...]] [--keep DIR] [--zst] [--report] [--merge]

For each size: generates a schema-valid synthetic trace (bench/gen_trace.py, signed like
pdtrace's own writer), then runs each of these in its own process and prints its wall time,
CPU time (user + system, with the processes it started) and peak RSS (the largest of the
process's ru_maxrss and its process tree's resident total, sampled every 50 ms):
- a bare ``orjson.loads`` loop over the file's lines, GC paused, keeping every event (what
  a whole-trace load holds: the yardstick of the goal);
- the same loop letting each event go (a lower bound no analysis reaches: parse only);
- ``pdtrace check TRACE -f json`` as a user runs it (streamed: the detectors' live state,
  not the trace; from 64 MiB on a 2-CPU host it splits the detectors over two processes,
  ``-j 2``, each parsing only the lines of its kinds);
- ``pdtrace check TRACE -f json -j 1``, the same in one process;
- ``pdtrace info TRACE`` (header + footer only: goal < 1 s at any size), and ``info --full``
  (every event read and counted in segments, as for a trace without a footer);
- with ``--report``, ``pdtrace report`` (goal < 5 MB output, peak RSS < 1 GB);
- with ``--merge``, ``pdtrace merge P D`` of the trace split back into its P and D halves
  (written once beside it, ``-P.jsonl`` / ``-D.jsonl``; goal: peak RSS < 1 GB).
With ``--zst`` all of it again on the trace zstd-compressed (the bare parses decompress as
they read). Prints ratios to the bare parse (wall and CPU: this host's wall times swing with
its neighbours; the CPU time is the steadier; a split check's CPU is both processes').
Goals (issue 22): check on 10M events peak RSS < 1 GB and time <= 1.5x the bare parse (also
for .zst); info < 1 s. A 10M-event trace is ~2.9 GB on disk; the keeping bare parse of it
needs ~15 GB of memory (``--no-keep`` skips it).
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

BARE = ("import gc, orjson, sys\nfrom pdtrace.tracefile.compress import open_read\ngc.disable()\nloads = orjson.loads\n"
        "out = []\nwith open_read(sys.argv[1])[0] as fh:\n    for line in fh:\n        out.append(loads(line))\n")
BARE_DROP = ("import gc, orjson, sys\nfrom pdtrace.tracefile.compress import open_read\ngc.disable()\nloads = orjson.loads\n"
             "with open_read(sys.argv[1])[0] as fh:\n    for line in fh:\n        loads(line)\n")


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants now (``check -j`` runs child processes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return total


def measure(argv: list[str]) -> tuple[float, float, int, float]:
    """(wall seconds, peak RSS in MB, exit code, CPU seconds) of one child process and the
    processes it starts: CPU is theirs together (wait4 counts the children it waited for);
    peak RSS is the larger of the process's own ru_maxrss and the sum over the process tree,
    sampled every 50 ms (where /proc has it)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, max(ru.ru_maxrss / 1024, peak / 2**20), proc.returncode, ru.ru_utime + ru.ru_stime


def split(path: str) -> list[str]:
    """The trace's P and D events as two traces (what `record` writes on each host)."""
    import orjson

    from pdtrace.tracefile.trace import write_trace
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
    ap.add_argument("--zst", action="store_true", help="also the same trace zstd-compressed (written once beside it)")
    a = ap.parse_args()
    tmp = a.keep or tempfile.mkdtemp(prefix="pdtrace-scale-")
    os.makedirs(tmp, exist_ok=True)
    for n in a.events:
        path = os.path.join(tmp, f"scale-{n}.jsonl")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            generate(path, n)
            print(f"generated {path} in {time.perf_counter() - t0:.0f} s")
        paths = [path]
        if a.zst:
            if not os.path.exists(path + ".zst"):
                compress(path, path + ".zst")
            paths.append(path + ".zst")
        for p in paths:
            bench_one(p, n, a)
    return 0


def compress(src: str, dst: str) -> None:
    """``src`` as one zstd stream at pdtrace's level (what ``record`` writes for ``.zst``)."""
    from pdtrace.tracefile.compress import open_write
    with open(src, "rb") as fh, open_write(dst, compressed=True) as out:
        while True:
            block = fh.read(1 << 22)
            if not block:
                break
            out.write(block)


def bench_one(path: str, n: int, a: argparse.Namespace) -> None:
    py = sys.executable
    mb = os.path.getsize(path) / 1e6
    print(f"\n== {n:,} events, {os.path.basename(path)}: {mb:,.0f} MB on disk")
    bare = None
    if not a.no_keep:
        bare = measure([py, "-c", BARE, path])
        print(f"bare parse, kept  : {bare[0]:7.1f} s  cpu {bare[3]:7.1f} s  peak RSS {bare[1]:8,.0f} MB")
    drop = measure([py, "-c", BARE_DROP, path])
    print(f"bare parse, let go: {drop[0]:7.1f} s  cpu {drop[3]:7.1f} s  peak RSS {drop[1]:8,.0f} MB")
    rows = [("check", [py, "-m", "pdtrace", "check", path, "-f", "json"]),
            ("check -j 1", [py, "-m", "pdtrace", "check", path, "-f", "json", "-j", "1"]),
            ("info", [py, "-m", "pdtrace", "info", path]),
            ("info --full", [py, "-m", "pdtrace", "info", "--full", path])]
    if a.report:
        rows.append(("report", [py, "-m", "pdtrace", "report", path, "-o", path + ".html"]))
    if a.merge and not path.endswith(".zst"):
        t0 = time.perf_counter()
        halves = split(path)
        print(f"split into P / D in {time.perf_counter() - t0:.0f} s (once)")
        rows.append(("merge", [py, "-m", "pdtrace", "merge", *halves, "-o", path + ".merged.jsonl"]))
    for name, argv in rows:
        wall, rss, rc, cpu = measure(argv)
        extra = ""
        if name.startswith("check"):
            if bare is not None:
                extra += (f"  ratio to the kept parse: wall {wall / bare[0]:.2f}, cpu {cpu / bare[3]:.2f} "
                          f"(goal <= 1.5);")
            extra += (f"  to the let-go parse: wall {wall / drop[0]:.2f}, cpu {cpu / drop[3]:.2f};"
                      f"  RSS {'OK' if rss < 1000 else 'OVER'} (goal < 1 GB)")
        elif name == "info --full":
            extra = (f"  ratio to the let-go parse: wall {wall / drop[0]:.2f};"
                     f"  RSS {'OK' if rss < 1000 else 'OVER'} (streamed: every event read, none kept)")
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
