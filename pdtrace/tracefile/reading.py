"""A trace file read in segments of consecutive events, in bounded memory: the fast path
(``segments.FastReader``) for a clean file, ``trace.scan_segments`` (every line checked and
named) for one that needs verdicts. Used by the streamed check (``detectors.stream``) and
the streamed merge (``pdtrace.merge``).

``fast_segments`` raises ``Rescan`` when the fast path cannot judge the file: a line that
needs a verdict, a footer digest that does not match the lines read (a field may have a
wrong type), a newer schema. The caller then reads the file again with ``scan_segments``,
from its start (it may already have used some segments).
"""

from __future__ import annotations

from typing import Any, Iterator

from .. import schema
from .ends import read_ends
from ..errors import TraceError
from .eventlist import EventList
from .segments import CUT_LINE, NO_FOOTER, SEGMENT, FastReader, FilterCannotTell, LineFilter, NeedsScan
from .trace import FOOTER_MISSING, LINE_CUT, Problem, ProgressFn, _all_valid, _open, _read_header, scan_segments

__all__ = ["Rescan", "Sink", "Unfiltered", "fast_segments", "read_through", "scan_segments", "SEGMENT"]


class Rescan(Exception):
    """Read the file again through ``scan`` (the fast path met something it cannot judge)."""


class Unfiltered(Rescan):
    """Read the file again without a line filter: the filter could not tell its lines apart
    (``segments.FilterCannotTell``); the one-reader fast path may still judge it."""


class Sink:
    """Where a pass puts the header, footer and problem lines it reads (``into`` below)."""

    def __init__(self) -> None:
        self.header: dict[str, Any] = {}
        self.footer: dict[str, Any] | None = None
        self.problems: list[Problem] = []


def read_through(path: str, lenient: bool, progress: ProgressFn | None, start: Any, size: int = SEGMENT) -> Any:
    """One whole pass over the trace: ``start(fast)`` gives ``(into, consume)``, and every
    segment goes to ``consume``. The fast path first; when it cannot judge the file, the pass
    starts over through scan with a fresh ``start(False)``. Returns that pass's ``into``."""
    for fast in (True, False):
        into, consume = start(fast)
        segs = (fast_segments(path, into, lenient, progress, size) if fast
                else scan_segments(path, into, lenient=lenient, progress=progress, size=size))
        try:
            for seg in segs:
                consume(seg)
            return into
        except Rescan:
            continue
    raise AssertionError("unreachable: scan does not ask for a rescan")


def fast_segments(path: str, into: Any, lenient: bool, progress: ProgressFn | None,
                  size: int = SEGMENT, keep: LineFilter | None = None,
                  header: dict[str, Any] | None = None) -> Iterator[EventList]:
    """The events of a clean trace in lists of ``size``; its header, footer and problems go
    into ``into`` (``header``, ``footer``, ``problems``), as ``scan_segments`` does. With
    ``keep``, only the lines it keeps (``segments.LineFilter``)."""
    fh, total, consumed = _open(path)
    with fh:
        into.header, _first = _read_header(path, fh, header)
        if into.header["schema_version"] > schema.SCHEMA_VERSION:
            raise Rescan
        # without a digest in the footer (or without a footer) every segment is type-checked
        # as it is read
        signed = True
        if fh.seekable():
            _h, foot, _size = read_ends(path, into.header)
            signed = bool(foot and foot.get("digest"))
        reader = FastReader(path, fh, total, consumed, progress, keep)
        try:
            for seg in reader.segments(size):
                if not signed and not _all_valid(seg):
                    raise Rescan
                yield seg
        except NeedsScan as exc:
            if isinstance(exc, FilterCannotTell):
                raise Unfiltered from None
            if str(exc) not in (NO_FOOTER, CUT_LINE) or signed:
                raise Rescan from None
            # every line before was whole, valid and type-checked: only the footer is missing,
            # maybe after a last line cut short (a recording killed); scan would say just that
            problems = [(reader.n_events + 2, FOOTER_MISSING)]
            if reader.cut_line is not None:
                problems = [(reader.cut_line, LINE_CUT), (reader.cut_line + 1, FOOTER_MISSING)]
            if not lenient:
                raise TraceError(path, *problems[0]) from None
            into.problems.extend(Problem(line, why) for line, why in problems)
            return
    if signed and not reader.digest_ok:
        raise Rescan  # (a segment may hold a wrong-typed field: scan names it)
    into.footer = reader.footer
