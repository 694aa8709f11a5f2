"""Zstandard-compressed traces (``.jsonl.zst``, issue 22): every reader opens them as it opens
a plain trace, and the writer compresses when the output name ends in ``.zst``.

A compressed trace is one zstd stream of exactly the lines of the plain trace; its footer
``digest`` covers the uncompressed lines, so ``zstd -d t.jsonl.zst`` gives a trace that
loads the same. Compressed files are recognised by their magic bytes, not their name.
Streams cannot be read backwards or at an offset without decompressing what comes before:
``pdtrace view`` decompresses to a temporary file first (and says so), ``pdtrace info`` reads
the whole stream (at decompression speed, not in constant time).
"""

from __future__ import annotations

import io
import os
from typing import IO, Any, Callable

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LEVEL = 3  # zstd's default: ~10x smaller on traces, faster than writing the plain bytes to most disks


def is_zstd(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == ZSTD_MAGIC
    except OSError:
        return False


def wants_zstd(path: str) -> bool:
    """Whether a trace written to ``path`` is compressed (its name ends in ``.zst``)."""
    return str(path).endswith(".zst")


def _zstd() -> Any:
    import zstandard  # a dependency of pdtrace; imported when a compressed trace is touched

    return zstandard


class _Reader(io.RawIOBase):
    """A raw, read-only stream of the decompressed bytes, frame after frame. zstd's errors become
    ``ValueError("corrupt zstd stream: ...")``, and a file that ends inside a frame (cut while
    written or copied) ``ValueError("compressed stream ends early: ...")`` once the bytes before
    the cut are returned. ``consumed()``: how much of the file was read."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._dctx = _zstd().ZstdDecompressor()
        self._obj: Any = None  # the current frame's decompressor
        self._raw = b""  # compressed bytes read but not yet fed
        self._out = memoryview(b"")  # decompressed bytes not yet returned
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not len(self._out):
            if self._done:
                return 0
            self._fill()
        k = min(len(b), len(self._out))
        b[:k] = self._out[:k]
        self._out = self._out[k:]
        return k

    def _fill(self) -> None:
        if not self._raw:
            self._raw = self._fh.read(1 << 16)
            if not self._raw:
                self._done = True
                if self._obj is not None and not self._obj.eof:
                    raise ValueError("compressed stream ends early: the file was cut inside its last zstd frame "
                                     "(the lines before the cut were read)")
                return
        if self._obj is None or self._obj.eof:
            self._obj = self._dctx.decompressobj()
        try:
            out = self._obj.decompress(self._raw)
        except _zstd().ZstdError as exc:
            raise ValueError(f"corrupt zstd stream: {exc}") from None
        self._raw = self._obj.unused_data if self._obj.eof else b""
        self._out = memoryview(out)

    def consumed(self) -> int:
        return self._fh.tell()

    def close(self) -> None:
        try:
            self._fh.close()
        finally:
            super().close()


def open_read(path: str) -> tuple[IO[bytes], int, Callable[[], int]]:
    """(a buffered binary reader of the trace's lines, the file's size on disk, a function
    giving how many bytes of the file were consumed so far: for progress). Raises OSError."""
    fh = open(path, "rb")
    size = os.fstat(fh.fileno()).st_size
    if fh.read(4) != ZSTD_MAGIC:
        fh.seek(0)
        return fh, size, fh.tell
    fh.seek(0)
    raw = _Reader(fh)
    return io.BufferedReader(raw, 1 << 16), size, raw.consumed  # (small reads: a damaged block loses less)


def open_write(path: str, *, compressed: bool | None = None) -> IO[bytes]:
    """A binary writer for a trace file: plain, or zstd-compressed when ``compressed`` (by
    default: when ``wants_zstd(path)``). Closing it finishes the stream and closes the file."""
    fh = open(path, "wb")
    if not (wants_zstd(path) if compressed is None else compressed):
        return fh
    return _zstd().ZstdCompressor(level=LEVEL).stream_writer(fh, closefd=True)


def decompress_to(path: str, out_path: str) -> int:
    """Write the decompressed trace to ``out_path``; returns its size."""
    z = _zstd()
    with open(path, "rb") as src, open(out_path, "wb") as dst:
        try:
            z.ZstdDecompressor().copy_stream(src, dst, read_size=1 << 20, write_size=1 << 20)
        except z.ZstdError as exc:
            raise ValueError(f"corrupt zstd stream: {exc}") from None
    return os.path.getsize(out_path)
