"""`pdtrace view TRACE`: open a trace (or a directory of shards) in the Textual TUI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import EXIT_OK, PdtraceError
from ..tracefile.compress import is_zstd, seek_table
from ..index.trace_index import TraceIndex
from ..index.shards import load_shards


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
        raise PdtraceError(f"{p}: cannot open: No such file or directory")  # check's wording
    shown = p
    if is_zstd(str(p)) and seek_table(str(p)) is None:
        p = _decompressed(p)  # pdtrace's own .zst (seekable) is indexed in place
    try:
        idx = _checked_index(p, shown)
    except BaseException:
        _remove_decompressed(str(p))  # (only a copy _decompressed made)
        raise
    idx.source = str(shown)
    return idx


def _checked_index(p: Path, shown: Path) -> TraceIndex:
    """The index of ``p`` once its line 1 is a pdtrace header; errors name ``shown`` (the
    file the user gave, where ``p`` is its decompressed copy)."""
    idx = TraceIndex(str(p), lenient=True)
    if idx.size == 0:
        idx.close()
        raise PdtraceError(f"{shown}: empty file: not a pdtrace trace")
    try:  # refuse a foreign file before starting the UI
        first = idx.head()
    except (ValueError, OSError) as exc:  # a .zst whose first frame is damaged
        idx.close()
        raise PdtraceError(f"{shown}: cannot read: {exc}") from None
    if not first.startswith(b"{") or b'"trace.header"' not in first:
        idx.close()
        raise PdtraceError(f"{shown}:1: not a pdtrace trace: line 1 is not a pdtrace 'trace.header' line")
    return idx


def _decompressed(p: Path) -> Path:
    """The viewer's index reads at byte offsets, which a zstd stream without a seek table (not
    written by pdtrace) does not have: decompress to a temporary file, kept while the viewer
    runs and deleted when it exits (``run``)."""
    import tempfile

    from ..tracefile.compress import decompress_to

    out = Path(tempfile.mkdtemp(prefix="pdtrace-view-")) / (p.name[:-4] if p.name.endswith(".zst") else p.name)
    print(f"pdtrace: {p} is zstd-compressed without a seek table (written by another tool, or a pdtrace trace "
          f"cut before its end); decompressing to {out} to index it", file=sys.stderr)
    try:
        size = decompress_to(str(p), str(out))
    except (ValueError, OSError) as exc:
        _remove_decompressed(str(out))
        raise PdtraceError(f"{p}: cannot decompress: {exc}") from None
    print(f"pdtrace: {size / 2**20:.1f} MB decompressed", file=sys.stderr)
    with open(out, "rb") as fh:  # said as `pdtrace check` says it: the stream ends inside a line
        fh.seek(max(0, size - 1))
        if size and fh.read(1) != b"\n":
            print(f"pdtrace: warning: {p}: compressed stream ends early: the file was cut inside its last zstd "
                  f"frame (the lines before the cut are shown; the viewer marks the trace incomplete)",
                  file=sys.stderr)
    return out


def run(trace: str | os.PathLike | None = None) -> int:
    index = open_source(trace)
    if not (sys.stdout.isatty() and sys.stdin.isatty()):  # a full-screen UI into a pipe is escape codes
        index.close()
        _remove_decompressed(index.path)
        where = "stdout" if not sys.stdout.isatty() else "stdin"
        raise PdtraceError(f"pdtrace view needs a terminal ({where} is not one); for text from a trace use "
                           f"`pdtrace check {trace}` or `pdtrace info {trace}`, for a page `pdtrace report {trace}`")
    from ..viewers.tui.app import PdtraceViewer  # Textual only when the viewer runs

    try:
        PdtraceViewer(index).run()
    finally:
        index.close()
        _remove_decompressed(index.path)
    return EXIT_OK


def _remove_decompressed(path: str | None) -> None:
    """Delete the temporary copy ``_decompressed`` made (only a file in a pdtrace-view-* dir)."""
    import shutil
    import tempfile

    if not path:
        return
    d = Path(path).parent
    if d.name.startswith("pdtrace-view-") and d.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(d, ignore_errors=True)
