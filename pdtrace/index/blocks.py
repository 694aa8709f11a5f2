"""The text of a trace for ``TraceIndex.scan``: line 1, then (offset, bytes) blocks of whole
lines (a last block may end without a newline: the file does), from an mmap of a plain file
or from the frames of a seekable ``.jsonl.zst`` (``zsource.FrameSource``). No Textual, no vLLM.
"""

from __future__ import annotations

import mmap
from typing import Any, Iterator

CHUNK = 4 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)

Blocks = Iterator[tuple[int, bytes]]


def mmap_blocks(mm: mmap.mmap, size: int) -> tuple[bytes, Blocks]:
    """Line 1 of a mapped plain trace, and ~``CHUNK`` blocks after it; pages already
    scanned are dropped from the process's memory (``MADV_DONTNEED``)."""
    nl = mm.find(b"\n")
    first = mm[: nl + 1 if nl >= 0 else size]
    return first, _chunks(mm, len(first), size)


def _chunks(mm: mmap.mmap, pos: int, size: int) -> Blocks:
    dropped = 0
    while pos < size:
        end = min(size, pos + CHUNK)
        if end < size:
            cut = mm.rfind(b"\n", pos, end)
            if cut < 0:  # one line longer than a chunk
                cut = mm.find(b"\n", end)
                end = size if cut < 0 else cut + 1
            else:
                end = cut + 1
        yield pos, mm[pos:end]
        if _DONTNEED is not None and end - dropped >= CHUNK:  # keep scanned pages out of our RSS
            try:
                mm.madvise(_DONTNEED, dropped, (end - dropped) & ~(mmap.PAGESIZE - 1))
            except (OSError, ValueError):
                pass
            dropped += (end - dropped) & ~(mmap.PAGESIZE - 1)
        pos = end


def frame_blocks(src: Any) -> tuple[bytes, Blocks]:
    """Line 1 of a seekable .zst (``src``: a FrameSource), and a block per frame after it. A
    damaged frame after the first gives a ``zsource.Gap`` in place of bytes, and the blocks go on
    after it; a damaged first frame raises ValueError here."""
    it = src.blocks(0, skip_damaged=True)
    try:
        _off, block = next(it)
    except StopIteration:
        return b"", iter(())
    if not isinstance(block, (bytes, bytearray)):  # the first frame is damaged: no line 1
        raise ValueError(block.reason)
    nl = block.find(b"\n")
    if nl < 0 or nl + 1 == len(block):
        return block, it
    return block[: nl + 1], _after(nl + 1, block[nl + 1:], it)


def _after(off: int, rest: bytes, it: Blocks) -> Blocks:
    yield off, rest
    yield from it
