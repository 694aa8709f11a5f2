"""Full-text search of a ``TraceIndex``'s raw event lines (the TUI's raw-event search).

The text is read in chunks (``TraceIndex._read``: os.pread, or a seekable .zst's frames) and
matched by ``re`` (C speed), and a match's byte offset is mapped back to an event ordinal by
bisecting the index's line starts: a search through a multi-GB trace parses no event. No
Textual, no vLLM.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import Any

import orjson

CHUNK = 4 << 20


def search(index: Any, text: str, start: int = 0, direction: int = 1, *, chunk: int = CHUNK) -> int | None:
    """The ordinal of the first event at or after ``start`` (``direction`` 1), or at or
    before it (-1), whose JSON line contains ``text`` (case-insensitive), or None.
    ``#N`` finds event id N. The file is read in chunks and matched by ``re`` (C speed),
    so a search through a multi-GB trace does not parse its events."""
    n = len(index.kinds)
    if not text or n == 0:
        return None
    if text.startswith("#") and text[1:].isdigit():
        o = index.ordinal(int(text[1:]))
        return o if 0 <= o < n else None
    start = min(max(start, 0), n - 1)
    pat = re.compile(re.escape(text.encode()), re.IGNORECASE)
    if index._memory is not None:
        rng = range(start, n) if direction > 0 else range(start, -1, -1)
        for i in rng:
            if pat.search(orjson.dumps(index._memory[i])):
                return i
        return None
    starts, lengths, read = index.starts, index.lengths, index._read
    first, end = starts[0], starts[n - 1] + lengths[n - 1]
    overlap = len(text.encode()) + 1
    if direction > 0:
        pos = starts[start]
        while pos < end:
            buf = read(min(chunk, end - pos), pos)
            m = pat.search(buf)
            if m:
                return bisect_right(starts, pos + m.start()) - 1
            if pos + len(buf) >= end:
                return None
            pos += max(len(buf) - overlap, 1)
        return None
    hi = starts[start] + lengths[start]
    while hi > first:
        lo = max(first, hi - chunk)
        buf = read(hi - lo, lo)
        last = None
        for m in pat.finditer(buf):
            last = m
        if last is not None:
            return bisect_right(starts, lo + last.start()) - 1
        if lo == first:
            return None
        hi = lo + overlap
    return None

