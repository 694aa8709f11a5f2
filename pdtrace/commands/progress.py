"""Progress of a long load on stderr, the way py-spy and nsys show theirs: one line that
updates in place, only on a terminal and only for files big enough to take a while."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

MIN_BYTES = 64 << 20  # smaller files load in about a second: no progress line


def load_progress(path: str, *, stream=None, verb: str = "loading") -> Callable[[int, int], None] | None:
    """A ``progress(done_bytes, total_bytes)`` callback for ``pdtrace.tracefile.trace.load`` that
    draws "loading NAME: 42% (113/269 MB)" on stderr (``verb`` for "loading": "checking",
    "merging"), or None when stderr is not a terminal or the file is small."""
    out = stream if stream is not None else sys.stderr
    try:
        big = os.path.getsize(path) >= MIN_BYTES
    except OSError:
        return None
    if not big or not (stream is not None or out.isatty()):
        return None
    name = os.path.basename(path)
    start = time.monotonic()

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        line = f"{verb} {name}: {pct:3d}% ({done >> 20}/{total >> 20} MB, {time.monotonic() - start:.0f} s)"
        out.write("\r" + line + ("\n" if done >= total else ""))
        out.flush()
    return progress
