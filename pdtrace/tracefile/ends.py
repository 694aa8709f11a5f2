"""A trace's header and footer without reading its events (``pdtrace info`` in constant
time, issue 22): line 1, and the last line found by reading backwards from the end. A
zstd-compressed trace written by pdtrace (seekable format: ``compress.seek_table``) gives its
last frame; another compressed trace is decompressed through (linear, at zstd's speed)."""

from __future__ import annotations

import os
from typing import Any

import orjson

from .. import schema
from .compress import is_zstd, read_frame, seek_table
from .trace import _open, _read_header

_MAX_FOOTER = 64 << 20  # a footer lists every process: large, but not this large


def read_ends(path: str, header: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """(header, footer or None, file size). The header is checked as ``load`` checks it
    (``TraceError`` on a foreign or newer file). The footer is None unless the file's last
    line is a whole, well-typed footer line; the events in between are not read, so a
    footer that is present says nothing about them. ``header``: line 1 as
    ``trace.read_header`` gave it (skipped, not parsed again)."""
    if is_zstd(path):
        return _read_ends_stream(path, header)
    fh, size, _consumed = _open(path)
    with fh:
        header, first = _read_header(path, fh, header)
        if size <= len(first):
            return header, None, size
        fh.seek(0, os.SEEK_END)
        end = size
        if _last_byte(fh, size) != b"\n":
            return header, None, size  # cut mid-line
        tail = b""
        step = 1 << 16
        start = end - 1  # before the final newline
        while True:
            lo = max(len(first), start - step)
            fh.seek(lo)
            tail = fh.read(start - lo) + tail
            nl = tail.rfind(b"\n")
            if nl >= 0:
                line = tail[nl + 1:]
                break
            if lo == len(first) or len(tail) > _MAX_FOOTER:
                line = tail if lo == len(first) else b""
                break
            start = lo
            step *= 2
    return header, _footer_or_none(line), size


def _read_ends_stream(path: str, header: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """A compressed trace: with a seek table (pdtrace writes one), its last frames, back to
    the one that holds the last line's start; without, decompress it all (at zstd's speed),
    keeping only the last line."""
    fh, size, _consumed = _open(path)
    with fh:
        header, _first = _read_header(path, fh, header)
        table = seek_table(path)
        if table:
            try:
                return header, _last_line_from_frames(path, table), size
            except (ValueError, OSError):  # a frame that does not match its entry: read it through
                pass
        last = b""
        try:
            while True:
                lines = fh.readlines(1 << 20)
                if not lines:
                    break
                last = lines[-1]
        except ValueError:  # a corrupt stream: no footer to trust
            return header, None, size
    if not last.endswith(b"\n"):
        return header, None, size
    return header, _footer_or_none(last), size


def _last_line_from_frames(path: str, table: list[tuple[int, int, int]]) -> dict[str, Any] | None:
    """The footer from the last line of a seekable compressed trace (None as ``read_ends``).
    Raises ValueError on a frame that is corrupt or does not match its seek table entry."""
    tail = b""
    for frame in reversed(table):
        tail = read_frame(path, frame) + tail
        if b"\n" in tail[:-1] or len(tail) > _MAX_FOOTER:
            break
    if not tail.endswith(b"\n"):
        return None
    return _footer_or_none(tail[tail.rfind(b"\n", 0, len(tail) - 1) + 1:])


def _footer_or_none(line: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict or obj.get("ev") != schema.FOOTER \
            or schema.type_error(obj, schema.FOOTER_CHECKS, "footer") is not None \
            or not obj.keys() >= {f.name for f in schema.FOOTER_FIELDS if f.required}:
        return None
    return obj


def _last_byte(fh: Any, size: int) -> bytes:
    fh.seek(size - 1)
    return fh.read(1)
