"""A clean trace read in segments of consecutive events (issue 22): ``trace.load`` joins
them into one list; ``pdtrace.detectors.stream`` hands each to the detectors and lets it
go, so ``check`` holds one segment at a time, not the trace.

``FastReader(path, progress).segments(size)`` yields ``EventList`` segments of about
``size`` events, each with the extras the loader records (kind groups, kind codes, whether
every id is its position in the trace). It is the fast path for a clean file: it raises
``NeedsScan`` at the first run or line that needs a verdict (bad JSON, not an event
object, unknown kind, an id that is not an integer, data after the footer, a newer schema),
and the caller re-reads the file through ``trace.scan``, which names the line. A file whose
only faults are a missing footer (``NO_FOOTER``), maybe after a last line cut short
(``CUT_LINE``, ``cut_line``), is read to its end before ``NeedsScan`` says so. Field types are not checked here: after the last segment ``digest_ok`` says whether
the footer's ``digest`` (a CRC-32 of the event lines, written only by a writer that
type-checked every event) matches the lines read; when it does not, the caller
type-checks (``trace.load``) or re-reads through ``scan`` (the stream, whose detectors have
already seen the events).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import itemgetter, not_
from typing import Any, Callable, Iterator
from zlib import crc32

import orjson

from .. import schema
from .eventlist import _KIND_CODE, EventList
from .typecheck import digest_of

_KIND_NAME = {code: name for name, code in _KIND_CODE.items()}
_ALLOC_MASK = bytes(int(i == _KIND_CODE["sched.alloc"]) for i in range(256))  # keeps sched.alloc (1)
_CHUNK = 1 << 16  # bytes parsed per orjson call
SEGMENT = 1 << 16  # events per segment handed to a stream's detectors

ProgressFn = Callable[[int, int], None]  # (bytes read, total bytes)


NO_FOOTER = "no footer"  # the NeedsScan of a file whose lines were all fine
CUT_LINE = "no footer after a last line cut short"  # ... all fine but the last, cut (``cut_line``)


class NeedsScan(Exception):
    """The file has a line that only ``trace.scan`` can judge (and name)."""


class FilterCannotTell(NeedsScan):
    """A ``LineFilter`` cannot split this file (a line that does not start with its kind, an
    event without its id): read it whole, not necessarily through scan."""


def _canon() -> tuple[str, str]:
    """The "ev" and "id" key objects as orjson returns them.

    They are the very ``str`` objects orjson returns for those keys (it caches short keys),
    so the lookups hit on identity and skip comparing strings; built per read since orjson's
    cache may have been recycled in between. Any other name objects would do, only slower."""
    names = ["ev", "id"]
    parsed = list(orjson.loads(orjson.dumps(dict.fromkeys(names, 0))))
    return (parsed[0], parsed[1]) if parsed == names else ("ev", "id")


def _prefixes(kind: str) -> tuple[bytes, bytes]:
    """How a line of ``kind`` starts: as orjson writes it, and as Python's json module does."""
    return b'{"ev":' + orjson.dumps(kind), b'{"ev": ' + orjson.dumps(kind)


_ALL_PREFIXES = tuple(p for k in (*_KIND_CODE, schema.FOOTER) for p in _prefixes(k))


class LineFilter:
    """Which lines of a trace one of several readers parses (``check -j``), told from each
    line's first bytes without parsing it: the writer puts ``ev`` first, so an event line
    starts ``{"ev":"KIND"`` (or ``{"ev": "KIND"``, Python's ``json.dumps``).
    ``LineFilter(kinds)`` keeps the lines of ``kinds`` and the footer;
    ``LineFilter(kinds, exclude=True)`` keeps every line but those of ``kinds``.

    A line that does not start the writer's way (a trace edited by hand) cannot be told
    apart: the excluding reader keeps it and, among its kept lines, finds one that starts
    with no known kind (``mask`` raises ``FilterCannotTell``); a kept line that parses into
    a kind the filter leaves to another reader makes ``foreign`` true. Either way the caller
    reads the file whole instead."""

    def __init__(self, kinds: Any, exclude: bool = False):
        kinds = set(kinds)
        self.exclude = exclude
        starts = kinds if exclude else kinds | {schema.FOOTER}
        self._prefixes = tuple(p for k in sorted(starts) for p in _prefixes(k))
        ours = (set(_KIND_CODE) - kinds) if exclude else kinds
        # ``codes.translate(None, delete)`` leaves the codes of kinds that are not ours
        self._ours = bytes(sorted(_KIND_CODE[k] for k in ours if k in _KIND_CODE))

    def mask(self, lines: list[bytes]) -> list[bool]:
        """Per line, whether this reader parses it (C-level passes over the lines)."""
        starts = map(bytes.startswith, lines, repeat(self._prefixes))
        if not self.exclude:
            return list(starts)
        mask = list(map(not_, starts))
        if not all(map(bytes.startswith, compress(lines, mask), repeat(_ALL_PREFIXES))):
            raise FilterCannotTell("a line that does not start with its kind")
        return mask

    def foreign(self, codes: bytes) -> bool:
        """Whether ``codes`` (kind codes of parsed lines) hold a kind this reader does not read."""
        return bool(codes.translate(None, self._ours))


class FastReader:
    """One pass over a clean trace (see the module docstring). ``header`` is read by the
    caller (``trace._read_header`` on the open file ``fh``); after the last segment,
    ``footer``, ``digest_ok``, ``n_events`` and ``blocks_derived`` are set.

    With ``keep`` (a ``LineFilter``) only the lines it keeps are parsed and handed out; the
    others still count (positions, ``n_events``) and go into the digest. Every kept event
    must then carry its ``id`` (the writer's way), and ``ids_aligned`` says that each id is
    its event's position in the file."""

    def __init__(self, path: str, fh: Any, total: int, consumed: Callable[[], int],
                 progress: ProgressFn | None = None, keep: LineFilter | None = None):
        self.path, self.fh, self.total, self.consumed, self.progress = path, fh, total, consumed, progress
        self.keep = keep  # which lines to parse (``LineFilter``); None: all
        self.footer: dict[str, Any] | None = None
        self.digest_ok = False
        self.n_events = 0
        self.blocks_derived = True  # no schema v2 sched.alloc without its block list
        self.cut_line: int | None = None  # the line number of a last line cut short

    def segments(self, size: int = SEGMENT) -> Iterator[EventList]:
        """The events in segments of about ``size`` (whole runs).

        The file is read in runs of whole lines (``readlines`` of about ``_CHUNK`` bytes);
        each run is parsed by one ``orjson.loads`` as a JSON array, its lines joined by
        commas (each keeps its newline: JSON whitespace). A valid JSON line holds no raw
        newline, so this is the same parse as one call per line, minus a Python call per
        line; small runs keep the new objects in the CPU cache for the bookkeeping loop that
        follows. A run must parse into exactly one value per line: a line with a stray
        top-level comma gives more values than lines, and an empty line or bad JSON fails
        the parse. Every event gets ``id`` (its position) if it has none. One loop per event
        checks it and files it under its kind."""
        fh, loads, progress, total, keep = self.fh, orjson.loads, self.progress, self.total, self.keep
        crc = 0  # of the event lines, for the footer's digest
        EV, ID = _canon()
        alloc_code = _KIND_CODE["sched.alloc"]
        BIDS, DERIVED = "block_ids", "block_ids_derived"
        n = 0
        footer = None
        next_progress = 0
        readlines, tell = fh.readlines, self.consumed
        code_of = _KIND_CODE.__getitem__
        get_ev, get_id = itemgetter(EV), itemgetter(ID)
        alloc_byte = bytes([alloc_code])
        seg, codes, aligned, whole = EventList(), bytearray(), True, True
        groups, appends = self._groups()
        while True:
            try:
                lines = readlines(_CHUNK)
            except ValueError:
                raise NeedsScan("a corrupt compressed stream") from None
            if not lines:
                break
            if footer is not None:
                raise NeedsScan("data after the footer")
            if lines[-1][-1:] != b"\n":  # the file's last line, cut short (a killed writer)
                try:
                    loads(lines[-1])
                    raise NeedsScan("a last line without its newline")  # (whole: scan reads it)
                except orjson.JSONDecodeError:
                    pass
                lines.pop()
                self.cut_line = n + len(lines) + 2  # (line 1 is the header)
                if not lines:
                    break
            raw, crc_before, last_len = b"".join(lines), crc, len(lines[-1])
            crc = crc32(raw, crc)
            n_lines = len(lines)
            if keep is None:
                positions: Any = range(n, n + n_lines)
            else:  # the positions of the kept lines: each event's id must say the same
                mask = keep.mask(lines)
                positions = list(compress(range(n, n + n_lines), mask))
                lines = list(compress(lines, mask))
                if not lines:
                    n += n_lines  # (no footer here: a filter keeps it)
                    self.n_events = n
                    continue
            lines[0] = b"[" + lines[0]
            lines[-1] += b"]"
            try:
                objs = loads(b",".join(lines))
            except orjson.JSONDecodeError:
                raise NeedsScan("bad JSON in the run") from None
            if len(objs) != len(lines):
                raise NeedsScan("a line holding more than one value")
            try:  # the common run, at C level: kinds, codes, ids (= positions), block lists
                cs = bytes(map(code_of, map(get_ev, objs)))
                ids = list(map(get_id, objs))
            except (KeyError, TypeError, IndexError):
                cs = None
            if cs is not None:
                if keep is not None and keep.foreign(cs):
                    raise FilterCannotTell("a kept line of a kind the filter leaves to another reader")
                if ids != list(positions):
                    if not all(type(i) is int for i in ids):
                        raise NeedsScan("a non-integer id")
                    aligned = False
                if whole and alloc_byte in cs:
                    allocs = list(compress(objs, cs.translate(_ALLOC_MASK)))
                    if None in map(dict.get, allocs, repeat(BIDS)) or any(map(dict.get, allocs, repeat(DERIVED))):
                        whole = self.blocks_derived = False  # a schema v2 sched.alloc for derive_block_lists
                for obj, c in zip(objs, cs):  # filed under its kind (the one Python step per event)
                    appends[c](obj)
                codes += cs
                n += n_lines
            else:  # the footer, an event without id, or a line for ``scan`` to judge: one by one
                for j, obj in enumerate(objs):
                    try:
                        code = code_of(obj[EV])
                    except (KeyError, TypeError, IndexError):
                        # the footer as the file's last line, or a line for ``scan`` to judge
                        if type(obj) is not dict or obj.get("ev") != schema.FOOTER or obj is not objs[-1] \
                                or schema.type_error(obj, schema.FOOTER_CHECKS, "footer") is not None:
                            raise NeedsScan("a line scan must judge") from None
                        footer = obj
                        crc = crc32(raw[:len(raw) - last_len], crc_before)  # (the footer line is not in the digest)
                        objs.pop()
                        n_lines -= 1
                        break
                    if keep is not None and keep.foreign(bytes((code,))):
                        raise FilterCannotTell("a kept line of a kind the filter leaves to another reader")
                    at = positions[j]
                    try:
                        if obj[ID] != at:  # an id from the file that is not the position
                            if type(obj[ID]) is not int:
                                raise NeedsScan("a non-integer id")
                            aligned = False
                    except KeyError:
                        if keep is not None:
                            raise FilterCannotTell("an event without its id (a filtered read needs them)") from None
                        obj[ID] = at
                    if code == alloc_code and whole and (obj.get(BIDS) is None or obj.get(DERIVED)):
                        whole = self.blocks_derived = False
                    codes.append(code)
                    appends[code](obj)
                n += n_lines
            seg.extend(objs)
            self.n_events = n
            if progress is not None and tell() >= next_progress:
                pos = tell()
                progress(pos, total)
                next_progress = pos + (1 << 24)
            if len(seg) >= size:
                yield self._done(seg, groups, codes, aligned, whole)
                seg, codes, aligned, whole = EventList(), bytearray(), True, True
                groups, appends = self._groups()
        if progress is not None:
            progress(total, total)
        if footer is None:  # (the events read are handed out first: a stream may keep them)
            if seg:
                yield self._done(seg, groups, codes, aligned, whole)
            raise NeedsScan(NO_FOOTER if self.cut_line is None else CUT_LINE)
        self.footer = footer
        self.digest_ok = footer.get("digest") == digest_of(crc)
        if seg or not n:
            yield self._done(seg, groups, codes, aligned, whole)

    @staticmethod
    def _groups() -> tuple[dict[int, list], list]:
        """Empty kind groups for a segment: {code: list}, and per code the list's append."""
        groups = {c: [] for c in _KIND_NAME}
        appends: list = [None] * (max(_KIND_NAME) + 1)
        for c, lst in groups.items():
            appends[c] = lst.append
        return groups, appends

    @staticmethod
    def _done(seg: EventList, groups: dict[int, list], codes: bytearray, aligned: bool, whole: bool) -> EventList:
        """The segment with its extras: kind groups, codes, whether its ids are their
        positions in the trace, whether each of its sched.alloc has its whole block list."""
        seg.by_kind = {_KIND_NAME[c]: lst for c, lst in groups.items() if lst}
        seg.kind_codes = codes
        seg.ids_aligned = aligned
        seg.blocks_derived = whole
        seg.loaded_len = len(seg)
        return seg
