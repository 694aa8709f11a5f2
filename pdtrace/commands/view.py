"""`pdtrace view TRACE`: open a trace (or a directory of shards) in the Textual TUI."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import EXIT_OK, PdtraceError
from ..index import TraceIndex, load_shards


def open_source(trace: str | os.PathLike | None) -> TraceIndex:
    """The index the viewer shows: a trace file (indexed by the app, lazily) or a
    directory of per-process shards merged in memory. Raises PdtraceError."""
    if trace is None:
        raise PdtraceError("no trace given: run `pdtrace view TRACE.jsonl` (or a directory of shards); "
                           "`pdtrace demo` shows a bundled sample")
    p = Path(trace)
    if p.is_dir():
        return load_shards(str(p))
    if not p.exists():
        raise PdtraceError(f"{p}: no such file")
    idx = TraceIndex(str(p), lenient=True)
    if idx.size == 0:
        idx.close()
        raise PdtraceError(f"{p}: empty file: not a pdtrace trace")
    with open(p, "rb") as fh:  # refuse a foreign file before starting the UI
        first = fh.readline(1 << 20)
    if not first.startswith(b"{") or b'"trace.header"' not in first:
        idx.close()
        raise PdtraceError(f"{p}:1: not a pdtrace trace: line 1 is not a pdtrace 'trace.header' line")
    return idx


def run(trace: str | os.PathLike | None = None) -> int:
    index = open_source(trace)
    from ..viewers.tui.app import PdtraceViewer  # Textual only when the viewer runs

    try:
        PdtraceViewer(index).run()
    finally:
        index.close()
    return EXIT_OK
