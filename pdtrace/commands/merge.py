"""`pdtrace merge P.jsonl D.jsonl -o trace.jsonl`: join traces of two hosts, aligning clocks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import PdtraceError, check_writable
from ..merge import merge_traces
from .progress import load_progress


def _fmt_ns(ns: int | None) -> str:
    if ns is None:
        return "unbounded"
    return f"{ns / 1e6:.3f} ms"


def run(inputs: list[Path], output: Path, lenient: bool = False) -> int:
    if len(inputs) < 1:
        raise PdtraceError("give at least one trace or shard directory")
    seen: dict[str, Path] = {}
    for p in inputs:
        if not Path(p).exists():
            raise PdtraceError(f"{p}: no such file or directory")
        real = os.path.realpath(p)
        if real in seen:
            raise PdtraceError(f"{p}: given twice (also as {seen[real]}): every event would be merged twice")
        seen[real] = Path(p)
    if os.path.realpath(output) in seen:
        raise PdtraceError(f"-o {output} is also an input: it would be overwritten; write the merge to another file")
    check_writable(Path(output))
    # two passes over each input (pdtrace.merge): a progress line for each on a terminal
    res = merge_traces([str(p) for p in inputs], str(output), lenient=lenient,
                       progress=lambda verb, path: load_progress(path, verb=f"{verb} (pass {1 if verb == 'reading' else 2} of 2)"))
    print(f"pdtrace: wrote {output} ({res['events']} events)", file=sys.stderr)
    for t in res["clock"]["traces"]:
        print(f"pdtrace: clock of {t['trace']} vs {res['clock']['reference']}: offset {_fmt_ns(t['offset_ns'])}, "
              f"residual skew <= {_fmt_ns(t['residual_ns'])} ({t['pairs']} KV hand-overs matched; {t['note']})",
              file=sys.stderr)
    for p in res["problems"]:
        print(f"pdtrace: warning: {p}", file=sys.stderr)
    return 0
