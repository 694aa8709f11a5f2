"""A byte-offset line index for large traces (no Textual, no vLLM).

``TraceIndex(path)`` keeps, per event, only its byte span and a few small columns
(kind, effective step, request, instance) in ``array`` objects -- about 30 bytes per
event -- and reads an event's JSON lazily with ``os.pread`` when a viewer pane needs it.
A zstd-compressed trace in the seekable format (pdtrace writes them so) is indexed in place:
offsets are those of the uncompressed lines, read through ``zsource.FrameSource``.
``scan(batch_time)`` builds the index from an ``mmap`` in batches and yields a
``ScanProgress`` after each batch, so a UI thread can show progress and a first screen
long before a multi-GB trace is indexed.

Validation follows ``pdtrace.tracefile.trace.scan``: same header rules, same problem texts
(truncated / blank / corrupt line, unknown kind, missing fields, data after the footer,
no footer), and every problem names its 1-based line. ``lenient=False`` raises
``TraceError`` at the first problem; ``lenient=True`` records it in ``problems``.

``TraceIndex.from_events(events, header)`` builds the same index over events already in
memory (shards merged by ``shards.load_shards``), so viewers see one interface.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
from array import array
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Sequence

import orjson

from .. import schema
from ..tracefile.compress import UNREAD, ZSTD_MAGIC, seek_table
from ..errors import TraceError
from .blocks import frame_blocks, mmap_blocks
from .columns import KIND_CODE, KIND_NAMES, NO_REQ, NO_STEP, UNKNOWN_KIND, ColumnQueries  # noqa: F401
from ..tracefile.trace import _KIND_REQUIRED, FOOTER_MISSING, Problem, _check_header
from ..tracefile.typecheck import EventChecker
from ..tracefile.zsource import Gap, gap_reason


@dataclasses.dataclass(frozen=True)
class ScanProgress:
    scanned: int  # bytes indexed so far
    total: int  # file size
    events: int  # events indexed so far
    requests: int  # distinct request ids so far
    problems: int
    done: bool = False

    @property
    def fraction(self) -> float:
        return 1.0 if not self.total else min(1.0, self.scanned / self.total)


class TraceIndex(ColumnQueries):
    """Offsets + small columns per event; parsed events only on demand."""

    def __init__(self, path: str | None = None, *, lenient: bool = True, cache_size: int = 4096):
        self.path = path
        self.source: str | None = None  # the file the user named, where ``path`` is its decompressed copy
        self.lenient = lenient
        self.header: dict[str, Any] = {}
        self.footer: dict[str, Any] | None = None
        self.problems: list[Problem] = []
        self.starts = array("q")
        self.lengths = array("I")
        self.kinds = array("B")
        self.steps = array("i")  # effective step: the event's step, else the last step seen on its instance
        self.reqs = array("i")
        self.insts = array("B")
        self.req_names: list[str] = []
        self.req_code: dict[str, int] = {}
        self.req_events: dict[int, array] = {}
        self.req_insts = array("B")  # per request: bit mask of instance codes (first 8 instances)
        self.inst_names: list[str] = []
        self.inst_code: dict[str, int] = {}
        self.step_ranges: dict[tuple[int, int], list[int]] = {}  # (inst, step) -> [first, last] ordinal
        self.first_of_kind: dict[tuple[int, int], int] = {}  # (inst, kind) -> first ordinal
        self.remote_req: dict[str, str] = {}  # D request -> P request (nixl.remote_alloc / nixl.read)
        self.id_to_ord: dict[int, int] = {}  # only where an event's ``id`` differs from its ordinal
        self.ord_to_id: dict[int, int] = {}
        self.size = 0
        self.done = False
        self.stream_damaged = False  # a .zst frame could not be read: the lines in it (or after it) are not indexed
        self.gaps: list[dict] = []  # damaged .zst frames skipped: line (its number), at (byte), lost (bytes), frames
        self._cur_step: dict[int, int] = {}
        self._base = 0
        self._checker = EventChecker()  # the same verdict as schema.type_error, once per event shape
        self._newer = False
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self._src: Any = None  # a zsource.FrameSource for a seekable .jsonl.zst
        self._memory: list[dict[str, Any]] | None = None
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        if path is not None:
            try:
                self._fd = os.open(path, os.O_RDONLY)
                self.size = os.fstat(self._fd).st_size
                if os.pread(self._fd, 4, 0) == ZSTD_MAGIC:
                    self._open_frames(path)
            except OSError as exc:
                self.close()
                raise TraceError(path, 0, f"cannot open: {exc.strerror or exc}") from None

    def _open_frames(self, path: str) -> None:
        """A zstd-compressed trace: read in place through its seek table (pdtrace writes one);
        ``size`` is then the uncompressed size, the offsets those of the uncompressed lines."""
        from ..tracefile.zsource import FrameSource

        frames = seek_table(path)
        if frames is None:
            self.close()
            raise TraceError(path, 0, "zstd-compressed without a seek table (written by another tool or an older pdtrace, or cut before its end), "
                                      "so it has no offsets to index; decompress it first (zstd -d), as "
                                      "`pdtrace view` does")
        self._src = FrameSource(path, frames)
        self.size = self._src.size

    def _read(self, length: int, offset: int) -> bytes:
        """``length`` bytes of the (uncompressed) trace text from ``offset``."""
        if self._src is not None:
            return self._src.pread(length, offset)
        return os.pread(self._fd, length, offset)  # type: ignore[arg-type]

    def head(self, limit: int = 1 << 20) -> bytes:
        """The trace's first line (at most ``limit`` bytes of it)."""
        data = self._read(min(limit, self.size), 0)
        nl = data.find(b"\n")
        return data if nl < 0 else data[: nl + 1]

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_events(cls, events: list[dict[str, Any]], header: dict[str, Any], *,
                    problems: Sequence[Problem] = (), source: str | None = None) -> "TraceIndex":
        idx = cls(None)
        idx.path = source
        idx.header = header
        idx.problems = list(problems)
        idx._memory = events
        for i, e in enumerate(events):
            if "id" not in e:
                e["id"] = i
            idx._add(e, i, 0)
        idx.done = True
        return idx

    def __len__(self) -> int:
        return len(self.kinds)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a slice still alive in another thread; the OS frees it at exit
                pass
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._src is not None:
            self._src.close()

    def _problem(self, line: int, reason: str) -> None:
        if not self.lenient:
            raise TraceError(self.path or "", line, reason)
        self.problems.append(Problem(line, reason))

    def _add(self, obj: dict[str, Any], start: int, length: int) -> None:
        n = self._base + len(self.kinds)  # (``_base``: rows a child scan has sent on and dropped)
        kind = obj["ev"]
        kc = KIND_CODE.get(kind, UNKNOWN_KIND)
        inst = obj.get("inst", "-")
        ic = self.inst_code.get(inst)
        if ic is None:
            ic = self.inst_code[inst] = len(self.inst_names)
            self.inst_names.append(inst)
        step = obj.get("step")
        if isinstance(step, int):
            self._cur_step[ic] = step
        else:
            step = self._cur_step.get(ic, NO_STEP)
        req = obj.get("req")
        rc = NO_REQ
        if isinstance(req, str):
            rc = self.req_code.get(req, NO_REQ)
            if rc == NO_REQ:
                rc = self.req_code[req] = len(self.req_names)
                self.req_names.append(req)
                self.req_events[rc] = array("i")
                self.req_insts.append(0)
            self.req_events[rc].append(n)
            if ic < 8:
                self.req_insts[rc] |= 1 << ic
            if kind in ("nixl.remote_alloc", "nixl.read") and obj.get("remote_req"):
                self.remote_req.setdefault(req, obj["remote_req"])
        eid = obj.get("id", n)
        if eid != n:
            self.id_to_ord[eid] = n
            self.ord_to_id[n] = eid
        self.starts.append(start)
        self.lengths.append(length)
        self.kinds.append(kc)
        self.steps.append(step)
        self.reqs.append(rc)
        self.insts.append(ic)
        if step != NO_STEP:
            r = self.step_ranges.get((ic, step))
            if r is None:
                self.step_ranges[(ic, step)] = [n, n]
            else:
                r[1] = n
        self.first_of_kind.setdefault((ic, kc), n)

    def _check_line(self, obj: Any, raw: bytes, line_no: int, at_eof: bool) -> dict[str, Any] | None:
        """Apply pdtrace.tracefile.trace's rules to one parsed line; return the event or None."""
        if obj is None:
            if at_eof and not raw.endswith(b"\n"):
                self._problem(line_no, "truncated line (no newline at end of file: the writer stopped mid-line)")
            elif not raw.strip():
                self._problem(line_no, "blank line")
            else:
                self._problem(line_no, "corrupt line: not valid JSON")
            return None
        kind = obj.get("ev") if isinstance(obj, dict) else None
        if kind is None:
            self._problem(line_no, "corrupt line: not a JSON object with an 'ev' field")
            return None
        if type(kind) is not str:
            self._problem(line_no, f"corrupt line: 'ev' should be a string, got {orjson.dumps(kind).decode()[:40]}")
            return None
        if self.footer is not None:
            self._problem(line_no, "data after the footer")
            return None
        if kind == schema.FOOTER:
            reason = schema.type_error(obj, schema.FOOTER_CHECKS, "footer")
            if reason is not None:
                self._problem(line_no, reason)
                obj = {"ev": schema.FOOTER}  # seen (data after it is still flagged), its summary not trusted
            self.footer = obj
            return None
        req = _KIND_REQUIRED.get(kind)
        if req is None:
            if not self._newer:
                self._problem(line_no, schema.new_kind_error(kind))
            return None
        if not obj.keys() >= req:
            self._problem(line_no, f"{kind}: missing field(s) {', '.join(sorted(req - obj.keys()))}")
            return None
        reason = schema.type_error(obj, schema.FIELD_CHECKS[kind], kind)
        if reason is not None:
            self._problem(line_no, reason)
            return None
        return obj

    def scan(self, batch_time: float = 0.1, child: bool = False) -> Iterator[ScanProgress]:
        """Index the file; yield progress after each ~``batch_time`` seconds of work. With
        ``child`` the lines are read and checked in a spawned process (``child.py``: the same
        index, this process only appends it), unless none can be started."""
        if child and self._fd is not None:
            from .child import start

            scan = start(self, batch_time)
            if scan is not None:
                return scan
        return self._scan(batch_time)

    def _scan(self, batch_time: float) -> Iterator[ScanProgress]:
        path = self.path or ""
        if self._fd is None:
            raise TraceError(path, 0, "nothing to scan (index built from events)")
        if self.size == 0:
            raise TraceError(path, 0, "empty file: not a pdtrace trace")
        if self._src is not None:
            try:
                first, blocks = frame_blocks(self._src)
            except ValueError as exc:  # the first frame is damaged: nothing to index
                raise TraceError(path, 1, str(exc)) from None
        else:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            first, blocks = mmap_blocks(self._mm, self.size)
        try:
            self.header = _check_header(path, orjson.loads(first))
        except orjson.JSONDecodeError:
            raise TraceError(path, 1, "not a pdtrace trace: line 1 is not JSON") from None
        self._newer = self.header["schema_version"] > schema.SCHEMA_VERSION
        if self._newer:
            self._problem(1, f"trace schema_version {self.header['schema_version']} is newer than this pdtrace "
                             f"reads ({schema.SCHEMA_VERSION}); known event kinds only")
        line_no = 1
        clock = time.monotonic
        deadline = clock() + batch_time
        while True:
            try:
                got = next(blocks, None)
            except ValueError as exc:  # a damaged zstd frame: the lines before it are indexed
                self._problem(line_no + 1, f"{exc}: {UNREAD}")
                self.stream_damaged = True
                break
            if got is None:
                break
            off, block = got
            if isinstance(block, Gap):  # damaged frames skipped (the seek table says where the next starts)
                self.gaps.append({"line": line_no + 1, "at": off, "lost": block.lost, "frames": block.frames})
                self._problem(line_no + 1, gap_reason(block.lost, block.frames, block.reason))
                self.stream_damaged = True
                line_no += 1
                continue
            line_no = self._index_block(block, off, line_no)
            if clock() >= deadline:
                yield self._progress(off + len(block))
                deadline = clock() + batch_time
        # no footer after a gap that ends before the file does: the trace ends early too
        if self.footer is None and (not self.stream_damaged or (self.gaps and not self._gap_at_end())):
            self._problem(line_no + 1, FOOTER_MISSING)
        self.done = True
        yield self._progress(self.size, done=True)

    def _gap_at_end(self) -> bool:
        return bool(self.gaps) and self.gaps[-1]["at"] + self.gaps[-1]["lost"] >= self.size

    def _index_block(self, block: bytes, off: int, line_no: int) -> int:
        """Index the lines of ``block`` (starting at byte ``off``, after line ``line_no``);
        returns the number of the last line. A block that does not end with a newline ends
        the file: its last line is checked as a cut one."""
        loads = orjson.loads
        JSONError = orjson.JSONDecodeError
        ok = self._checker.ok
        lines = block.split(b"\n")
        tail = lines.pop()  # b"" when the block ends with a newline
        for raw in lines:
            line_no += 1
            ln = len(raw) + 1
            try:
                obj = loads(raw)
            except JSONError:
                obj = None
            if obj is not None and ok(obj) and self.footer is None:
                self._add(obj, off, ln)  # fast path: a valid event (its shape seen valid before: one lookup)
            else:
                ev = self._check_line(obj, raw + b"\n", line_no, False)
                if ev is not None:
                    self._add(ev, off, ln)
            off += ln
        if tail:  # the file ends without a newline
            line_no += 1
            try:
                obj = loads(tail)
            except JSONError:
                obj = None
            ev = self._check_line(obj, tail, line_no, True)
            if ev is not None:
                self._add(ev, off, len(tail))
        return line_no

    def build(self) -> "TraceIndex":
        for _ in self.scan(batch_time=1.0):
            pass
        return self

    def _progress(self, pos: int, done: bool = False) -> ScanProgress:
        return ScanProgress(pos, self.size, len(self.kinds), len(self.req_names), len(self.problems), done)

    # ---------------------------------------------------------------- reading
    def event_id(self, i: int) -> int:
        return self.ord_to_id.get(i, i)

    def ordinal(self, event_id: int) -> int:
        return self.id_to_ord.get(event_id, event_id)

    def kind(self, i: int) -> str:
        kc = self.kinds[i]
        return KIND_NAMES[kc] if kc != UNKNOWN_KIND else "?"

    def event(self, i: int) -> dict[str, Any]:
        """The parsed event at ordinal ``i`` (pread + orjson, LRU-cached)."""
        if self._memory is not None:
            return self._memory[i]
        with self._lock:
            hit = self._cache.get(i)
            if hit is not None:
                self._cache.move_to_end(i)
                return hit
        obj = orjson.loads(self._read(self.lengths[i], self.starts[i]))
        if "id" not in obj:
            obj["id"] = self.event_id(i)
        with self._lock:
            self._cache[i] = obj
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return obj

    def events(self, ordinals: Iterable[int]) -> list[dict[str, Any]]:
        return [self.event(i) for i in ordinals]

    def iter_events(self, ordinals: Iterable[int] | None = None) -> Iterator[dict[str, Any]]:
        """Parse events in order without caching them (bulk passes: detectors)."""
        if self._memory is not None:
            yield from (self._memory if ordinals is None else (self._memory[i] for i in ordinals))
            return
        loads = orjson.loads
        rng = range(len(self.kinds)) if ordinals is None else ordinals
        starts, lengths, read = self.starts, self.lengths, self._read
        for i in rng:
            obj = loads(read(lengths[i], starts[i]))
            if "id" not in obj:
                obj["id"] = self.event_id(i)
            yield obj
