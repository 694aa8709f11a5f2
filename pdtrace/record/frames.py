"""Shard frames: the on-disk form of one process's queued events (``<pid>.pdshard``).

A frame is SHARD_MAGIC, then little-endian u32 payload length, u32 number of queued events,
u32 crc32 of the payload, u32 crc32 of the 12 bytes before it (FRAME_HEAD), then the payload:
``marshal.dumps(((pid, role, inst, rank, wall_offset_ns), [(kind, t_mono_ns, req, step,
fields), ...]), 4)`` (``pdtrace.record.recorder.Recorder._encode_frame``). The writer appends whole
frames (``write_frame``: loops over short writes, cuts a failed frame back off); the magic and
checksums let the reader resynchronise after a damaged stretch (a crash mid-write, a cut that
failed), and a header whose checksum holds says how many events its lost payload held.
PDS1 frames (pdtrace before the checksums: b"PDS1" + u32 length + payload) are still read.
"""

from __future__ import annotations

import errno
import marshal
import mmap
import os
import struct
import zlib
from typing import Any, Iterator

from ..tracefile.trace import Problem

SHARD_MAGIC = b"PDS2"
SHARD_SUFFIX = ".pdshard"
FRAME_HEAD = struct.Struct("<4sIIII")
_HEAD_FIELDS = struct.Struct("<III")


def frame_head(length: int, count: int, payload_crc: int) -> bytes:
    return FRAME_HEAD.pack(SHARD_MAGIC, length, count, payload_crc,
                           zlib.crc32(_HEAD_FIELDS.pack(length, count, payload_crc)))


def write_frame(fh: Any, frame: bytes) -> None:
    """Append one frame to an unbuffered shard file (the recorder's writer thread). Loops over
    short writes; when a write fails (disk full), cuts the file back to where the frame began,
    so the shard stays a sequence of whole frames, and raises (the recorder counts the batch
    as dropped). Should the cut fail too, the reader resynchronises on the next frame."""
    start = fh.seek(0, os.SEEK_END)
    view = memoryview(frame)
    done = 0
    try:
        while done < len(frame):
            n = fh.write(view[done:])
            if not n:
                raise OSError(errno.EIO, "shard write made no progress")
            done += n
    except BaseException:
        try:  # (also when the failing call wrote a part before raising)
            fh.truncate(start)
        except OSError:
            pass
        raise


_OLD_MAGIC = b"PDS1"  # frames without checksum or count (pdtrace before PDS2)


def read_frames(path: str) -> tuple[list[tuple[Any, Any]], list[Problem]]:
    """The ``(meta, items)`` of every intact frame of a shard file, and its problems (see
    ``iter_frames``)."""
    problems: list[Problem] = []
    return list(iter_frames(path, problems)), problems


_RELEASE = 4 << 20  # hand mapped pages already read back to the kernel every 4 MiB (RSS counts them)


def iter_frames(path: str, problems: list[Problem]) -> Iterator[tuple[Any, Any]]:
    """Yield the ``(meta, items)`` of every intact frame of a shard file, in file order, and
    append its problems to ``problems``. A damaged frame (bad magic, bad checksum, cut short,
    not unmarshallable) does not end the read: the reader scans forward to the next intact
    frame and goes on; each damaged stretch becomes one problem saying how many bytes were
    skipped and, where the frame header survived, how many events they held
    (``Problem.lost``). The file is memory-mapped and the pages behind the read position are
    released as it goes, so memory stays bounded by a frame, not by the shard."""
    name = os.path.basename(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield from _frames(data, size, name, problems)
    finally:
        data.close()


def _frames(data: Any, size: int, name: str, problems: list[Problem]) -> Iterator[tuple[Any, Any]]:
    old = data[:4] == _OLD_MAGIC
    magic = _OLD_MAGIC if old else SHARD_MAGIC
    head = 8 if old else FRAME_HEAD.size
    pos, n, released = 0, 0, 0
    while pos < size:
        if pos - released >= _RELEASE and hasattr(data, "madvise"):
            upto = pos - pos % mmap.PAGESIZE
            data.madvise(mmap.MADV_DONTNEED, released, upto - released)
            released = upto
        n += 1
        why, lost, nxt = "", 0, pos
        if size - pos < head:
            why = "truncated header (process killed mid-write)" if data[pos:pos + 4] == magic[:size - pos] \
                or data[pos:size] == magic[:size - pos] else "trailing bytes that are not a frame"
            nxt = size
        elif data[pos:pos + 4] != magic:
            why = "bad magic"
        else:
            if old:
                (length,), count, crc, head_ok = struct.unpack_from("<I", data, pos + 4), 0, None, True
            else:
                _m, length, count, crc, hcrc = FRAME_HEAD.unpack_from(data, pos)
                head_ok = zlib.crc32(data[pos + 4:pos + 16]) == hcrc
            end = pos + head + length
            if not head_ok:
                why = "damaged frame header"
            elif end > size:
                why, lost = f"truncated ({size - pos - head} of {length} bytes; process killed mid-write?)", count
            else:
                payload = data[pos + head:end]
                if crc is not None and zlib.crc32(payload) != crc:
                    why, lost = "checksum mismatch", count
                else:
                    try:
                        frame = marshal.loads(payload)
                        meta, items = frame
                    except Exception as exc:  # noqa: BLE001 - any decoding failure is a damaged frame
                        why, lost = f"corrupt ({type(exc).__name__})", count
                    else:
                        pos = end
                        yield meta, items
                        continue
        if nxt < size:  # resynchronise: the next place a whole frame starts
            nxt = data.find(magic, pos + 1)
            nxt = size if nxt < 0 else nxt
        held = f", {lost} event(s) lost" if lost else ""
        problems.append(Problem(n, f"{name}: frame {n} at byte {pos}: {why}; skipped {nxt - pos} byte(s){held}"
                                   + ("" if nxt >= size else ", read on from the next frame"), lost=lost))
        pos = nxt
