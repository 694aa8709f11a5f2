"""Trace loader: the only code that reads trace files.

``load(path)`` reads a whole trace into a ``Trace`` (header, events, footer, problems);
``iter_events(path)`` streams events without keeping them. Events are plain dicts with
the field names of ``pdtrace.schema`` (fast to parse, nothing to convert).

Errors name the line: a truncated last line, a corrupt line, a foreign file, an unknown
event kind, or a header with a newer ``schema_version`` raise ``TraceError(path, line,
reason)`` unless ``lenient=True``, in which case every valid event is kept and each bad
line becomes a ``Problem`` in ``trace.problems``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator

import orjson

from .. import schema
from .compress import CUT_STREAM, UNREAD, is_zstd, open_read, seek_table
from .zsource import GAP_MARK, gap_of_line, is_gap, open_frames
from ..errors import TraceError
from .footer import make_footer  # noqa: F401 - part of this module's API
from .segments import FastReader, NeedsScan
from .typecheck import EventChecker
from .eventlist import EventList, kind_code, kind_groups, select_kinds  # noqa: F401 - API
from .writer import make_header, write_trace  # noqa: F401 - part of this module's API

FOOTER_MISSING = "no footer here, after the last line: the trace ends early (recording killed, or file cut)"
LINE_CUT = "truncated line (no newline at end of file: the writer stopped mid-line)"
_KIND_REQUIRED = {name: schema.REQUIRED_COMMON | k.required for name, k in schema.KINDS.items()}


@dataclasses.dataclass
class Problem:
    line: int
    reason: str
    lost: int = 0  # events known lost with it (a damaged shard frame's count)
    file: str = ""  # which input, where several are read (merge)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}" if self.file else f"line {self.line}: {self.reason}"


def is_complete(footer: dict[str, Any] | None, problems: Any) -> bool:
    """Footer intact, no damaged line, and nothing lost when it was written (the footer's
    ``input_problems`` / ``shard_problems``: ``damage.footer_damage`` says them in words)."""
    return (footer is not None and not problems
            and not footer.get("input_problems") and not footer.get("shard_problems"))


@dataclasses.dataclass
class Trace:
    path: str
    header: dict[str, Any]
    events: list[dict[str, Any]]
    footer: dict[str, Any] | None
    problems: list[Problem]
    gap_after: int | None = None  # the last event id read before the first skipped .zst gap (None: no gap)

    @property
    def complete(self) -> bool:
        return is_complete(self.footer, self.problems)

    @property
    def n_events(self) -> int:
        return len(self.events)

    def versions(self) -> dict[str, str]:
        return dict(self.header.get("versions") or {})


ProgressFn = Callable[[int, int], None]  # (bytes read, total bytes)


def _check_header(path: str, obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or obj.get("ev") != schema.HEADER or obj.get("schema") != schema.SCHEMA_NAME:
        raise TraceError(path, 1, "not a pdtrace trace: line 1 is not a pdtrace 'trace.header' line")
    ver = obj.get("schema_version")
    if type(ver) is not int or ver < 1:  # (true is not a version)
        shown = orjson.dumps(ver).decode()[:40] if "schema_version" in obj else "none"
        raise TraceError(path, 1, f"header schema_version must be a positive integer, got {shown}")
    reason = schema.type_error(obj, schema.HEADER_CHECKS, "header")
    if reason is not None:
        raise TraceError(path, 1, reason)
    return obj


def _open(path: str) -> tuple[Any, int, Callable[[], int]]:
    """Open a trace for reading, plain or zstd-compressed (``pdtrace.tracefile.compress``): (binary
    reader of its lines, size on disk, bytes of the file consumed so far)."""
    try:
        frames = seek_table(path) if is_zstd(path) else None
        if frames:  # pdtrace's seekable .zst: a damaged frame is skipped to the next one (zsource)
            return open_frames(path, frames)
        return open_read(path)
    except OSError as exc:
        raise TraceError(path, 0, f"cannot open: {exc.strerror or exc}") from None


def _lines(fh: Any) -> Iterator[Any]:
    """The reader's lines; a corrupt compressed stream ends them with its ``ValueError``."""
    try:
        yield from fh
    except ValueError as exc:
        yield exc


def read_header(path: str) -> dict[str, Any]:
    """Line 1 of the trace at ``path``, checked as ``load`` checks it (``TraceError`` otherwise).
    A caller that reads the file again hands it on (``header=`` of ``load``, ``scan``, the
    segment readers and the streamed check): line 1 is then skipped, not parsed again."""
    fh, _total, _consumed = _open(path)
    with fh:
        return _read_header(path, fh)[0]


def _read_header(path: str, fh: Any, known: dict[str, Any] | None = None) -> tuple[dict[str, Any], bytes]:
    """Read and check line 1 of an open trace: (header, the raw line). ``known``: the header
    already read by ``read_header`` (the line is read past, not parsed)."""
    if known is not None:
        try:
            return known, fh.readline()
        except ValueError as exc:  # a corrupt compressed stream
            raise TraceError(path, 1, str(exc)) from None
    try:
        first = fh.readline()
    except ValueError as exc:  # a corrupt compressed stream
        raise TraceError(path, 1, str(exc)) from None
    if not first:
        raise TraceError(path, 0, "empty file: not a pdtrace trace")
    if first.startswith(GAP_MARK):  # the first frame of a .zst is damaged: no line 1
        raise TraceError(path, 1, orjson.loads(first[len(GAP_MARK):])["reason"])
    try:
        return _check_header(path, orjson.loads(first)), first
    except orjson.JSONDecodeError:
        raise TraceError(path, 1, "not a pdtrace trace: line 1 is not JSON") from None


def scan(
    path: str,
    *,
    lenient: bool = False,
    progress: ProgressFn | None = None,
    validate: bool = True,
    header: dict[str, Any] | None = None,
) -> Iterator[tuple[str, int, Any]]:
    """Yield ("header"|"event"|"footer"|"problem", line_no, payload) for each line.

    Raises TraceError at the first problem unless ``lenient``. ``header``: line 1 as
    ``read_header`` gave it.
    """
    fh, total, consumed = _open(path)
    loads = orjson.loads
    required = _KIND_REQUIRED
    newer = False
    with fh:
        header, first = _read_header(path, fh, header)
        if header["schema_version"] > schema.SCHEMA_VERSION:
            reason = (f"trace schema_version {header['schema_version']} is newer than this pdtrace reads "
                      f"({schema.SCHEMA_VERSION}); upgrade pdtrace, or use --lenient to read known event kinds")
            if not lenient:
                raise TraceError(path, 1, reason)
            newer = True
            yield "problem", 1, reason
        yield "header", 1, header
        line_no = 1
        pos = len(first)
        next_progress = 0
        footer_seen = False
        for raw in _lines(fh):
            line_no += 1
            if type(raw) is ValueError:  # the rest of a compressed stream cannot be read
                reason = str(raw) if str(raw).startswith(CUT_STREAM) else f"{raw}: {UNREAD}"
                if not lenient:
                    raise TraceError(path, line_no, reason)
                yield "problem", line_no, reason
                footer_seen = None  # (its footer may be there, unread: not "no footer")
                break
            if raw.startswith(GAP_MARK):  # damaged .zst frames skipped (zsource.FramesReader): said, read on
                if not lenient:
                    raise TraceError(path, line_no, gap_of_line(raw))
                yield "problem", line_no, gap_of_line(raw)
                footer_seen = footer_seen or None  # (None: the footer may be in the gap, not "no footer")
                continue
            footer_seen = footer_seen or False  # (lines after a gap: the footer must come after them)
            pos += len(raw)
            if progress is not None and pos >= next_progress:
                pos = consumed()
                progress(pos, total)
                next_progress = pos + (1 << 24)
            problem = None
            try:
                obj = loads(raw)
            except orjson.JSONDecodeError:
                if not raw.endswith(b"\n"):
                    problem = LINE_CUT
                elif not raw.strip():
                    problem = "blank line"
                else:
                    problem = "corrupt line: not valid JSON"
                obj = None
            if problem is None:
                kind = obj.get("ev") if isinstance(obj, dict) else None
                if kind is None:
                    problem = "corrupt line: not a JSON object with an 'ev' field"
                elif footer_seen:
                    problem = "data after the footer"
                elif kind == schema.FOOTER:
                    footer_seen = True
                    problem = schema.type_error(obj, schema.FOOTER_CHECKS, "footer")
                    if problem is None:
                        yield "footer", line_no, obj
                        continue
                elif validate:
                    req = required.get(kind) if type(kind) is str else None
                    if req is None:
                        problem = (schema.new_kind_error(kind) if type(kind) is str
                                   else f"corrupt line: 'ev' should be a string, got {orjson.dumps(kind).decode()[:40]}")
                        if newer and type(kind) is str:  # expected: a newer writer has kinds we do not know
                            continue
                    elif not obj.keys() >= req:
                        problem = f"{kind}: missing field(s) {', '.join(sorted(req - obj.keys()))}"
                    else:
                        problem = schema.type_error(obj, schema.FIELD_CHECKS[kind], kind)
            if problem is not None:
                if not lenient:
                    raise TraceError(path, line_no, problem)
                yield "problem", line_no, problem
                continue
            yield "event", line_no, obj
        if progress is not None:
            progress(total, total)
        if footer_seen is False:
            reason = FOOTER_MISSING
            if not lenient:
                raise TraceError(path, line_no + 1, reason)
            yield "problem", line_no + 1, reason


def _all_valid(events: list[dict[str, Any]]) -> bool:
    """Whether every event passes the schema's type check (``EventChecker``): the fast
    loader's check of a file whose footer has no matching ``digest``."""
    checker = EventChecker()
    shapes, learn = checker.shapes, checker.learn
    for obj in events:
        try:
            nested = shapes[(obj["ev"], tuple(obj), tuple(map(type, obj.values())))]
        except KeyError:
            if not learn(obj):
                return False
            continue
        if nested is not None and not nested(obj):
            return False
    return True


def _load_fast(path: str, progress: ProgressFn | None, known: dict[str, Any] | None = None) -> Trace | None:
    """The common case, a clean trace, read by ``pdtrace.tracefile.segments.FastReader`` in one tight
    loop (no per-line generator / tuples) and joined into one ``EventList``, with the
    extras it recorded (kind groups, kind codes, whether ids are positions).

    Field types: when the footer's ``digest`` does not match the lines read (or is absent),
    every event is type-checked (``_all_valid``) before the trace is returned.

    Returns None at the first run or line that needs a verdict (``segments.NeedsScan``), or
    a wrong-typed field: ``load`` then re-reads the file through ``scan``, which produces
    the exact errors / problems with their line numbers. Opening and header errors are
    raised here exactly as ``scan`` raises them."""
    fh, total, consumed = _open(path)
    events = EventList()
    groups: dict[str, list[dict[str, Any]]] = {}
    codes = bytearray()
    aligned = True
    with fh:
        header, _first = _read_header(path, fh, known)
        if header["schema_version"] > schema.SCHEMA_VERSION:
            return None
        reader = FastReader(path, fh, total, consumed, progress)
        try:
            for seg in reader.segments(1 << 62):  # (one segment: the whole file)
                events.extend(seg)
                for k, lst in seg.by_kind.items():  # type: ignore[union-attr]
                    have = groups.get(k)
                    if have is None:
                        groups[k] = lst
                    else:
                        have.extend(lst)
                codes += seg.kind_codes  # type: ignore[operator]
                aligned = aligned and seg.ids_aligned
        except NeedsScan:
            return None
    if not reader.digest_ok and not _all_valid(events):
        return None  # a wrong-typed field: scan names it
    events.by_kind = groups
    events.kind_codes = codes
    events.ids_aligned = aligned
    events.blocks_derived = reader.blocks_derived  # nothing for derive_block_lists to do
    events.loaded_len = len(events)
    return Trace(path, header, events, reader.footer, [])


def derive_block_lists(events: Iterable[dict[str, Any]]) -> int:
    """Fill in ``block_ids`` of ``sched.alloc`` events that only carry ``new_block_ids``
    (schema v2: a running request's call that appended blocks). The full list is the
    previous sched.alloc's of the same (pid, inst, req) plus the new ids, per group; the
    event gets ``block_ids_derived: true``. An event with no earlier list (a trace cut at
    its start) is left without ``block_ids``. Events must be in trace order. Returns how
    many were derived.

    Only ``sched.alloc`` events matter, so passing just those (in trace order) gives the
    same result. For a list from ``load`` the loader noted whether any sched.alloc needs
    this (``EventList.blocks_derived``): the call is free when none does or once done, and
    otherwise walks that kind's group only. Other inputs are checked first (one look at
    each sched.alloc) and walked only when something is to be derived."""
    loaded = isinstance(events, EventList) and events.as_loaded()
    if loaded and events.blocks_derived:  # type: ignore[union-attr]
        return 0
    by_kind = kind_groups(events) if loaded else None  # type: ignore[arg-type]
    if by_kind is not None:
        allocs: list[dict[str, Any]] = by_kind.get("sched.alloc", [])
    else:
        allocs = [e for e in events if e.get("ev") == "sched.alloc"]
    n = 0
    for e in allocs:
        if e.get("block_ids") is None or e.get("block_ids_derived"):
            n = _derive(allocs)
            break
    if loaded:
        events.blocks_derived = True  # type: ignore[union-attr]
    return n


def _derive(allocs: list[dict[str, Any]], held: dict[tuple, list] | None = None) -> int:
    """``derive_block_lists`` over ``allocs``; ``held`` (the latest list per request) carries
    over from earlier segments of the same trace (``pdtrace.detectors.stream``)."""
    if held is None:
        held = {}
    n = 0
    for e in allocs:
        key = (e.get("pid"), e.get("inst"), e.get("req"))
        full = e.get("block_ids")
        if full is None or e.get("block_ids_derived"):
            prev = held.get(key)
            new = e.get("new_block_ids") or []
            if prev is None:
                continue
            full = [list(prev[g]) + list(new[g] if g < len(new) else ())
                    for g in range(max(len(prev), len(new)))]
            e["block_ids"] = full
            e["block_ids_derived"] = True
            n += 1
        if e.get("ok", True):
            held[key] = full
    return n


def load(path: str, *, lenient: bool = False, progress: ProgressFn | None = None,
         header: dict[str, Any] | None = None) -> Trace:
    """The whole trace at ``path`` (``header``: line 1 as ``read_header`` gave it)."""
    tr = _load(path, lenient=lenient, progress=progress, header=header)
    if tr.header.get("schema_version", 1) >= 2:
        derive_block_lists(tr.events)
    return tr


def _load(path: str, *, lenient: bool = False, progress: ProgressFn | None = None,
          header: dict[str, Any] | None = None) -> Trace:
    import gc

    # Parsing creates millions of small dicts; the cyclic GC would rescan them over and over
    # while they can hold no cycles. Pause it for the load (restored even on errors).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tr = _load_fast(path, progress, header)
        if tr is None:
            tr = _load_scan(path, lenient=lenient, progress=progress, header=header)
        _promote(gc)
        return tr
    finally:
        if was_enabled:
            gc.enable()


def _promote(gc: Any) -> None:
    """Move everything the load allocated to the oldest GC generation, without a collection.

    With the GC paused all loaded objects are still "young"; the first allocation after it
    is re-enabled would start a young collection that walks every one of them (about a
    third of the parse time), and a middle-generation one would walk them again later.
    ``freeze`` + ``unfreeze`` splice the generation lists (no traversal) and reset the
    young counters, so the events are left to full collections, which run only after many
    more objects survive. Skipped when the process froze objects itself (``unfreeze``
    would release them too)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def _load_scan(path: str, *, lenient: bool = False, progress: ProgressFn | None = None,
               header: dict[str, Any] | None = None) -> Trace:
    tr = Trace(path, {}, EventList(), None, [])
    for seg in scan_segments(path, tr, lenient=lenient, progress=progress, header=header):
        tr.events.extend(seg)
    tr.events.loaded_len = len(tr.events)  # type: ignore[attr-defined]
    return tr


def scan_segments(path: str, into: Any, *, lenient: bool = False, progress: ProgressFn | None = None,
                  size: int = 1 << 62, header: dict[str, Any] | None = None) -> Iterator[EventList]:
    """``scan``'s events in lists of ``size`` (an event without ``id`` gets its position);
    the header, the footer and each problem line go into ``into`` (its ``header``,
    ``footer`` and ``problems``): ``load`` of a file that needs verdicts, and the streamed
    check's second pass (``pdtrace.detectors.stream``)."""
    seg = EventList()
    n = 0
    last_id = -1
    for what, line, obj in scan(path, lenient=lenient, progress=progress, header=header):
        if what == "event":
            if "id" not in obj:
                obj["id"] = n
            n += 1
            last_id = obj["id"]
            seg.append(obj)
            if len(seg) >= size:
                yield seg
                seg = EventList()
        elif what == "header":
            into.header = obj
        elif what == "footer":
            into.footer = obj
        else:
            into.problems.append(Problem(line, obj))
            if getattr(into, "gap_after", 0) is None and is_gap(obj):  # (the findings after it: checking.py)
                into.gap_after = last_id
    if seg:
        yield seg


def iter_events(path: str, *, lenient: bool = False) -> Iterator[dict[str, Any]]:
    n = 0
    for what, _line, obj in scan(path, lenient=lenient):
        if what == "event":
            if "id" not in obj:
                obj["id"] = n
            n += 1
            yield obj
