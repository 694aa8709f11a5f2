"""What the KV invariant (kv-invariant, issue 59) adds to `check`: time and memory, as ratios.

    python bench/invariant.py [--events 1000000] [--jobs 0 1] [--rounds 2] [--keep DIR]

Generates a schema-valid synthetic P/D trace (bench/gen_trace.py, spec decode, every bug class injected, each
instance's blocks from a bounded pool as vLLM's), then runs ``pdtrace check TRACE -f json -j JOBS`` with every class
(today's check) and with the six rules only (``--only`` each of them: the check before the invariant), alternating,
each in its own process; prints each run's wall time, CPU time (user + system, its child processes included) and
peak RSS (ru_maxrss: the largest process of the run), and the ratios all / rules-only of the medians, per JOBS
(0: as `check` runs by default, two processes from 64 MB of trace on two CPUs or more; 1: one process).
Goal (issue 59): check with the invariant within 1.3x of the rules-only check, in time and memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from pdtrace.detectors.base import ALL_KINDS, KV_INVARIANT  # noqa: E402


def run(cmd: list[str]) -> tuple[float, float, int, int]:
    """(wall s, CPU s, peak RSS MB, exit code) of one process."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid, status, ru = os.wait4(p.pid, 0)
    return time.monotonic() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss // 1024, os.waitstatus_to_exitcode(status)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--jobs", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", help="directory for the generated trace (default: a temporary one)")
    a = ap.parse_args()
    from gen_trace import generate

    d = a.keep or tempfile.mkdtemp(prefix="pdtrace-bench-inv-")
    os.makedirs(d, exist_ok=True)  # (--keep DIR: made when it is not there yet)
    path = os.path.join(d, f"gen-{a.events}.jsonl")
    if not os.path.exists(path):
        generate(path, a.events)
    rules = [x for k in ALL_KINDS if k != KV_INVARIANT for x in ("--only", k)]
    arms = {}
    for j in a.jobs:
        base = [sys.executable, "-m", "pdtrace", "check", path, "-f", "json", "-j", str(j)]
        arms[(j, "all seven")], arms[(j, "six rules")] = base, base + rules
    got: dict[tuple, list] = {k: [] for k in arms}
    for _ in range(a.rounds):
        for (j, name), cmd in arms.items():
            w, c, rss, rc = run(cmd)
            got[(j, name)].append((w, c, rss))
            print(f"-j {j}  {name:10} exit {rc}  wall {w:6.1f} s  cpu {c:6.1f} s  peak RSS {rss:5d} MB", flush=True)
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in got.items()}
    for j in a.jobs:
        a7, a6 = med[(j, "all seven")], med[(j, "six rules")]
        print(f"{a.events} events, -j {j}{' (auto)' if j == 0 else ''}, median of {a.rounds}: all / rules-only = "
              f"wall {a7[0] / a6[0]:.2f}x, cpu {a7[1] / a6[1]:.2f}x, peak RSS {a7[2] / a6[2]:.2f}x (goal <= 1.3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
