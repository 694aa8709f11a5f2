"""`pdtrace demo`: check the bundled buggy sample trace and say what to run next."""

from __future__ import annotations

import os
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
    print("  (recorded from real vLLM 0.32.0 scheduler + NIXL connector code on CPU with the pre-fix")
    print("   'P reports its lookahead block' rule re-introduced as a labelled fault; see sample_traces/README.md)\n")
    code = check.run(trace=path, format="text", only=[], request=None, what_if=None, output=None, lenient=False)
    rel = os.path.relpath(path) if len(os.path.relpath(path)) < len(str(path)) else str(path)
    print("\nNext:")
    print(f"  pdtrace view {rel}                 # step through it in the terminal")
    print(f"  pdtrace check {rel} --what-if fixed-trim   # what the fixed rule would have mapped")
    print(f"  pdtrace report {rel} -o report.html")
    # the demo succeeded if it found the seeded bug
    return 0 if code == 1 else 3
