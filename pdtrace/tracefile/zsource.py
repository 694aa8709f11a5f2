"""Byte-offset reads from a seekable ``.jsonl.zst`` trace, without decompressing it to disk.

``TraceIndex`` (the TUI's lazy index) keeps each event's byte span in the *uncompressed*
lines. A trace written by pdtrace is in zstd's seekable format (``compress.seek_table``):
independent frames of ~4 MiB uncompressed each, so the bytes at any offset come from one or
two frames. ``FrameSource.pread`` decompresses only those (and keeps the last few decompressed,
since a viewer reads neighbouring events), and ``blocks`` gives the whole text in order, cut at
line ends, for the index's scan. A compressed file without a seek table (another tool's single
stream) cannot be read this way: ``pdtrace view`` decompresses it to a temporary file first.
No Textual, no vLLM.
"""

from __future__ import annotations

import io
import os
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from typing import Any, Callable, Iterator

import orjson

from .compress import decompress_frame

KEEP = 4  # decompressed frames kept for random reads (~16 MiB)


class FrameSource:
    """The uncompressed bytes of a seekable zstd file, by offset. ``frames``: the file's
    ``seek_table`` (offset in the file, compressed size, decompressed size) per frame.
    Thread-safe: the viewer reads events while its worker scans. Raises ValueError on a
    frame that is corrupt or does not match its table entry, OSError when the file cannot
    be read."""

    def __init__(self, path: str, frames: list[tuple[int, int, int]], *, keep: int = KEEP):
        self.path = path
        self.frames = frames
        self.starts = array("q")  # uncompressed offset of each frame's first byte
        at = 0
        for _off, _c, d in frames:
            self.starts.append(at)
            at += d
        self.size = at  # uncompressed bytes
        self.disk_size = os.path.getsize(path)
        self._fd: int | None = os.open(path, os.O_RDONLY)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _decompress(self, k: int, exact: bool = True) -> bytes:
        at, csize, dsize = self.frames[k]
        if self._fd is None:
            raise ValueError(f"{self.path}: closed")
        return decompress_frame(os.pread(self._fd, csize, at), at, dsize if exact else None)

    def frame(self, k: int) -> bytes:
        """Frame ``k``'s uncompressed bytes (LRU-cached)."""
        with self._lock:
            hit = self._cache.get(k)
            if hit is not None:
                self._cache.move_to_end(k)
                return hit
        data = self._decompress(k)  # outside the lock: zstd releases the GIL while it works
        with self._lock:
            self._cache[k] = data
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return data

    def pread(self, length: int, offset: int) -> bytes:
        """Up to ``length`` uncompressed bytes from ``offset`` (fewer at the end), as os.pread."""
        end = min(self.size, offset + length)
        if offset >= end:
            return b""
        k = bisect_right(self.starts, offset) - 1
        parts = []
        while offset < end:
            data = self.frame(k)
            lo = offset - self.starts[k]
            piece = data[lo: lo + (end - offset)]
            parts.append(piece)
            offset += len(piece)
            k += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def blocks(self, pos: int = 0, skip_damaged: bool = False, exact: bool = True) -> Iterator[tuple[int, bytes | "Gap"]]:
        """(offset, bytes) from ``pos`` to the end, in order: each block holds whole lines (it
        ends with a newline), except a last one that the file ends without. Frames read here
        are not cached (a scan would only evict what the viewer is showing). A frame that
        cannot be read raises ValueError, or with ``skip_damaged`` gives (offset, Gap) and the
        reading goes on at the first whole line of the next frame that can be read (the seek
        table says where each frame is): the line cut by the gap on either side is lost too.
        ``exact=False`` (the loader, which needs no offsets): a frame whose size differs from
        its table entry is read as it is, not taken for damage."""
        if pos >= self.size:
            return
        k = bisect_right(self.starts, pos) - 1
        carry = b""
        start = pos
        gap: Gap | None = None
        for j in range(k, len(self.frames)):
            try:
                data = self._decompress(j, exact)
            except ValueError as exc:
                if not skip_damaged:
                    raise
                if gap is None:  # the partial line before the gap goes with it
                    gap = Gap(start, str(exc))
                    carry = b""
                gap.frames += 1
                continue
            if j == k:
                data = data[pos - self.starts[k]:]
            if gap is not None:  # resume at the first line that starts in this frame
                nl = data.find(b"\n")
                if nl < 0:  # no line starts here: the gap goes on
                    continue
                resume = self.starts[j] + nl + 1
                gap.lost = resume - gap.start
                yield gap.start, gap
                gap = None
                data = data[nl + 1:]
                start = resume
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line ends in this frame: a line longer than a frame
                carry += data
                continue
            block = carry + data[:cut] if carry else data[:cut]
            yield start, block
            start += len(block)
            carry = data[cut:]
        if gap is not None:  # the file's last frames were damaged
            gap.lost = self.size - gap.start
            yield gap.start, gap
        elif carry:
            yield start, carry


class Gap:
    """Where ``FrameSource.blocks(skip_damaged=True)`` skipped damaged frames: from uncompressed
    byte ``start`` (the start of the line the first damaged frame cut), ``lost`` bytes, ``frames``
    frames; ``reason``: the first frame's error."""

    __slots__ = ("start", "lost", "frames", "reason")

    def __init__(self, start: int, reason: str):
        self.start, self.reason, self.lost, self.frames = start, reason, 0, 0


# A line no writer makes (not JSON: it starts with a NUL) that ``FramesReader`` puts where
# damaged frames were skipped, so a line reader (``trace.scan``) says so and reads on; the
# gap counts as one line, as in the viewer's index.
GAP_MARK = b"\x00pdtrace-gap "


def gap_reason(lost: int, frames: int, first: str) -> str:
    """The problem a skipped gap is, in the viewer's index and the loader alike."""
    return f"{lost} uncompressed bytes lost ({frames} damaged zstd frame(s) and the lines they cut); first: {first}"


def is_gap(reason: str) -> bool:
    """Whether a problem's reason is a gap of skipped frames (``gap_reason``)."""
    return "uncompressed bytes lost (" in reason and "damaged zstd frame(s)" in reason


def gap_of_line(raw: bytes) -> str | None:
    """The problem of a ``GAP_MARK`` line, or None for any other line."""
    if not raw.startswith(GAP_MARK):
        return None
    g = orjson.loads(raw[len(GAP_MARK):])
    return gap_reason(g["lost"], g["frames"], g["reason"])


class FramesReader(io.RawIOBase):
    """The lines of a seekable .jsonl.zst in order, for the loader (``trace._open``): a
    damaged frame is skipped to the next one (``FrameSource.blocks(skip_damaged=True)``), a
    ``GAP_MARK`` line in its place. ``consumed()``: bytes of the file read so far (progress)."""

    def __init__(self, src: FrameSource) -> None:
        self._src = src
        self._it = src.blocks(0, skip_damaged=True, exact=False)
        self._out = memoryview(b"")
        self._pos = 0  # uncompressed bytes handed out (a gap's included)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not len(self._out):
            got = next(self._it, None)
            if got is None:
                return 0
            off, block = got
            if isinstance(block, Gap):
                data = GAP_MARK + orjson.dumps({"lost": block.lost, "frames": block.frames, "reason": block.reason}) + b"\n"
                self._pos = off + block.lost
            else:
                data = block
                self._pos = off + len(block)
            self._out = memoryview(data)
        k = min(len(b), len(self._out))
        b[:k] = self._out[:k]
        self._out = self._out[k:]
        return k

    def consumed(self) -> int:
        if self._pos <= 0:
            return 0
        at, csize, _d = self._src.frames[bisect_right(self._src.starts, self._pos - 1) - 1]
        return at + csize

    def close(self) -> None:
        try:
            self._src.close()
        finally:
            super().close()


def open_frames(path: str, frames: list[tuple[int, int, int]]) -> tuple[Any, int, Callable[[], int]]:
    """``compress.open_read``'s triple for a seekable file, read through ``FramesReader``."""
    raw = FramesReader(FrameSource(path, frames))
    return io.BufferedReader(raw, 1 << 16), raw._src.disk_size, raw.consumed
