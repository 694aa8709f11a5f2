"""Zstandard-compressed traces (``.jsonl.zst``, issue 22): every reader opens them as it opens
a plain trace, and the writer compresses when the output name ends in ``.zst``.

A compressed trace holds exactly the lines of the plain trace; its footer ``digest`` covers
the uncompressed lines, so ``zstd -d t.jsonl.zst`` gives a trace that loads the same.
Compressed files are recognised by their magic bytes, not their name. pdtrace writes them in
zstd's seekable format (contrib/seekable_format in the zstd repository): independent frames
of ``FRAME_BYTES`` uncompressed bytes, then a seek table in a skippable frame, which every
zstd decoder passes over. ``seek_table`` reads that table, so ``pdtrace info`` decompresses
only the last frame to find the footer; a compressed trace without one (another tool's
single stream) is read through to its end. ``pdtrace view`` indexes a seekable file in place
(``zsource.FrameSource``) and decompresses any other to a temporary file first (and says so).
"""

from __future__ import annotations

import io
import os
import struct
from typing import IO, Any, Callable

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LEVEL = 3  # zstd's default: ~10x smaller on traces, faster than writing the plain bytes to most disks
FRAME_BYTES = 4 << 20  # uncompressed bytes per frame (the seekable format's unit)
SKIPPABLE_SEEK_MAGIC = 0x184D2A5E  # the skippable frame that holds the seek table
SEEKABLE_MAGIC = 0x8F92EAB1  # the seek table's last four bytes
_TABLE_FOOTER = struct.Struct("<IBI")  # number of frames, descriptor, SEEKABLE_MAGIC


# How a compressed stream that cannot be read on says so (``_Reader``, ``decompress_frame``):
# the lines after it are lost to a reader, which is not a cut recording (the footer may be there).
CUT_STREAM = "compressed stream ends early"
STREAM_DAMAGE = ("corrupt zstd", CUT_STREAM, "the zstd frame")
UNREAD = "the lines after it cannot be read"


def stream_damage(reason: str) -> bool:
    """Whether a problem's reason is a compressed stream that stops being readable."""
    return str(reason).startswith(STREAM_DAMAGE)


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
                    raise ValueError(f"{CUT_STREAM}: the file was cut inside its last zstd frame "
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
    default: when ``wants_zstd(path)``), in the seekable format. Closing it writes the last
    frame and the seek table, and closes the file."""
    fh = open(path, "wb")
    if not (wants_zstd(path) if compressed is None else compressed):
        return fh
    return _SeekableWriter(fh)  # type: ignore[return-value]


class _SeekableWriter(io.RawIOBase):
    """Independent zstd frames of ``FRAME_BYTES`` uncompressed bytes each, then the seek
    table: a skippable frame of (compressed size, decompressed size) per frame and the
    table's footer (frame count, descriptor 0: no checksums in the table, ``SEEKABLE_MAGIC``).
    Each frame carries zstd's own content checksum (XXH64), so bytes damaged inside a frame
    fail its decompression (the readers skip it: ``zsource``) instead of decoding into
    plausible lines that are not the ones written."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._cctx = _zstd().ZstdCompressor(level=LEVEL, write_content_size=True, write_checksum=True)
        self._buf = bytearray()
        self._frames: list[tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._buf += b
        while len(self._buf) >= FRAME_BYTES:
            self._frame(bytes(self._buf[:FRAME_BYTES]))
            del self._buf[:FRAME_BYTES]
        return len(b)

    def _frame(self, data: bytes) -> None:
        out = self._cctx.compress(data)
        self._fh.write(out)
        self._frames.append((len(out), len(data)))

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._buf or not self._frames:
                self._frame(bytes(self._buf))
                self._buf = bytearray()
            entries = b"".join(struct.pack("<II", c, d) for c, d in self._frames)
            body = entries + _TABLE_FOOTER.pack(len(self._frames), 0, SEEKABLE_MAGIC)
            self._fh.write(struct.pack("<II", SKIPPABLE_SEEK_MAGIC, len(body)) + body)
        finally:
            self._fh.close()
            super().close()


def seek_table(path: str) -> list[tuple[int, int, int]] | None:
    """The frames of a trace written in zstd's seekable format, as (offset in the file,
    compressed size, decompressed size); None when the file does not end with a seek table
    that accounts for every byte before it (a plain file, another writer's stream, a file
    cut short)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8 + _TABLE_FOOTER.size:
                return None
            fh.seek(size - _TABLE_FOOTER.size)
            n, desc, magic = _TABLE_FOOTER.unpack(fh.read(_TABLE_FOOTER.size))
            entry = 12 if desc & 0x80 else 8
            table = 8 + n * entry + _TABLE_FOOTER.size
            if magic != SEEKABLE_MAGIC or desc & 0x7C or table > size:
                return None
            fh.seek(size - table)
            raw = fh.read(table)
    except OSError:
        return None
    skip_magic, frame_size = struct.unpack_from("<II", raw)
    if skip_magic != SKIPPABLE_SEEK_MAGIC or frame_size != table - 8:
        return None
    frames, at = [], 0
    for i in range(n):
        c, d = struct.unpack_from("<II", raw, 8 + i * entry)
        frames.append((at, c, d))
        at += c
    return frames if at == size - table else None


def read_frame(path: str, frame: tuple[int, int, int]) -> bytes:
    """The decompressed bytes of one frame of ``seek_table(path)``. Raises ValueError on a
    corrupt frame, OSError when the file cannot be read."""
    at, csize, dsize = frame
    with open(path, "rb") as fh:
        fh.seek(at)
        raw = fh.read(csize)
    return decompress_frame(raw, at, dsize)


def decompress_frame(raw: bytes, at: int, dsize: int | None) -> bytes:
    """One frame's compressed bytes (``raw``, read from byte ``at`` of the file) decompressed;
    ValueError when they are corrupt or do not make the ``dsize`` bytes the seek table says
    (``dsize`` None: whatever whole frame they hold, for a reader that needs no offsets)."""
    if len(raw) == 0 and dsize:
        raise ValueError(f"the zstd frame at byte {at} of the compressed file is missing: the file ends before it")
    if dsize is None:  # (the error said as the exact read says it; a frame without its size: streamed)
        try:
            return _zstd().ZstdDecompressor().decompress(raw)
        except _zstd().ZstdError as exc:
            first = exc
        obj = _zstd().ZstdDecompressor().decompressobj()
        try:
            out = obj.decompress(raw)
        except _zstd().ZstdError:
            out = None
        if out is None or not obj.eof:
            raise ValueError(f"corrupt zstd frame at byte {at} of the compressed file: {first}") from None
        return out
    try:
        out = _zstd().ZstdDecompressor().decompress(raw, max_output_size=dsize)
    except _zstd().ZstdError as exc:
        raise ValueError(f"corrupt zstd frame at byte {at} of the compressed file: {exc}") from None
    if len(out) != dsize:
        raise ValueError(f"the zstd frame at byte {at} of the compressed file holds {len(out)} bytes, its seek "
                         f"table entry {dsize}")
    return out


def decompress_to(path: str, out_path: str) -> int:
    """Write the decompressed trace to ``out_path``; returns its size."""
    z = _zstd()
    with open(path, "rb") as src, open(out_path, "wb") as dst:
        try:
            z.ZstdDecompressor().copy_stream(src, dst, read_size=1 << 20, write_size=1 << 20)
        except z.ZstdError as exc:
            raise ValueError(f"corrupt zstd stream: {exc}") from None
    return os.path.getsize(out_path)
