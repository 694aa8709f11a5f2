"""`pdtrace demo`: check the bundled buggy sample trace and say what to run next."""

from __future__ import annotations

import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from ..errors import PdtraceError

DEMO_TRACE = "demo_lookahead_misalignment.jsonl"


def demo_trace_path() -> Path:
    p = resources.files("pdtrace") / "samples" / DEMO_TRACE
    path = Path(str(p))
    if not path.exists():
        raise PdtraceError(f"the bundled sample {DEMO_TRACE} is missing from this installation ({path})")
    return path


def run() -> int:
    from . import check

    path = demo_trace_path()
    print(f"pdtrace demo: checking the bundled sample {path.name}")
    print("  (recorded from real vLLM 0.32.0 scheduler + NIXL connector code on CPU, with")
    print("   the pre-fix 'P reports its lookahead block' rule put back as a labelled")
    print("   fault; a copy of sample_traces/lookahead_aligned16_k1_buggy.jsonl; its")
    print("   provenance: sample_traces/README.md)\n")
    code = check.run(trace=path, format="text", only=[], request=None, what_if=None, output=None, lenient=False)
    rel = str(path)  # absolute: the lines below work from any directory
    # the command as it can be typed here: `pdtrace` when it is on PATH, else the script that ran
    # (the README's set-up runs .venv/bin/pdtrace without activating the venv)
    exe = "pdtrace"
    found = shutil.which("pdtrace")
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if (not found or os.path.realpath(found) != os.path.realpath(argv0)) and os.path.basename(argv0) == "pdtrace":
        exe = os.path.relpath(argv0) if not os.path.relpath(argv0).startswith("..") else argv0
    print("\nNext:")
    print("  # step through it in the terminal (f: next finding, ?: every key)")
    print(f"  {exe} view {rel}")
    print("  # what the fixed rule would have mapped")
    print(f"  {exe} check {rel} --what-if fixed-trim")
    print("  # one self-contained HTML page")
    print(f"  {exe} report {rel} -o report.html")
    # the demo succeeded if it found the seeded bug
    return 0 if code == 1 else 3
