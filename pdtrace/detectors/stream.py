"""`check` in bounded memory (issue 22): the trace is read in segments of consecutive
events (``pdtrace.tracefile.segments``), each segment is fed to every detector's ``Stream`` and to a
``Summary`` for the coverage verdicts, then let go. Memory is the detectors' live state
(open requests and transfers, each worker's recent copies and row moves, the findings),
not the trace.

Each detector has one implementation: ``detect(events)`` feeds its ``Stream`` the whole
list as one segment. What the streams keep is bounded per process or per live request
(see each module's ``Stream``), so a trace read in segments gives the findings of the same
trace loaded whole; ``tests/test_stream.py`` checks it on every sample and corpus trace
with segments of a few events.

A clean file is read by the fast path (``segments.FastReader``). When it meets a line that
needs a verdict, or the footer's digest does not match the lines read (a field may have a
wrong type), or a detector fails on a value the fast path did not type-check, the file is
read again through ``trace.scan``, which checks every line and names the bad ones
(``lenient``: keeps the good ones). A flight-recorder trace (``ring_s``, bounded by
construction) is loaded whole: the ring-cut rules look back over all of it.
"""

from __future__ import annotations

import gc
import re
from itertools import repeat
from operator import itemgetter
from typing import Any, Callable

from .. import schema
from ..tracefile.reading import SEGMENT, Rescan, fast_segments, scan_segments
from ..tracefile.trace import Problem, ProgressFn, _derive, is_complete
from . import (DETECTORS, crossed, drafter_window, kv_invariant, kv_load, lease_verdict, lookahead, metadata, sort_key,
               stale_read)
from .base import Finding
from .coverage import CLASSES, RUNNER_KINDS, WHOLE_KINDS, matching
from .index import Configs, Index

STREAMS: dict[str, Callable[[dict], Any]] = {
    lookahead.LOOKAHEAD_MISALIGNMENT: lookahead.Stream,
    metadata.METADATA_CLEARED_BEFORE_DRAFTER: metadata.Stream,
    drafter_window.DRAFTER_WINDOW_OUTSIDE_ALLOCATION: drafter_window.Stream,
    stale_read.STALE_ACCEPTED_COUNT_READ: stale_read.Stream,
    kv_load.KV_LOAD_FAILURE_RECOVERY: kv_load.Stream,
    crossed.KV_NEVER_CROSSED: crossed.Stream,
    kv_invariant.KV_INVARIANT: kv_invariant.Stream,
}
assert tuple(STREAMS) == tuple(DETECTORS)


def _feeds() -> list[tuple[str, dict]]:
    """Every class's feeds, each (kind, filter) once (two classes may read the same one)."""
    out = {(k, tuple(sorted(f.items()))): (k, f) for spec in CLASSES.values() for k, f in spec.feeds}
    return list(out.values())


def _na_kinds() -> set[str]:
    """The kinds whose pids ``coverage`` asks for (``Summary.pids``): proc.start (processes whose
    hooks.status is missing) and those that rule a class out on a runner."""
    return {"proc.start"} | {kind for spec in CLASSES.values() for kind, _why in spec.na_when.values()}


class Summary:
    """What ``coverage`` reads of a trace (the interface of ``coverage.IndexFacts``),
    gathered segment by segment: the few events of ``WHOLE_KINDS`` kept whole; per kind the
    count and the pids; the ``runner`` values of the worker kinds; and each bug class's
    feed counts."""

    def __init__(self, kinds: Any = None) -> None:
        self._whole: dict[str, list] = {k: [] for k in WHOLE_KINDS}
        self._n: dict[str, int] = {}
        self._pids: dict[str, set] = {}
        self._runners: set = set()
        self._kinds = None if kinds is None else frozenset(kinds)  # only these (``check -j``)
        self._feeds = [(k, f) for k, f in _feeds() if self._kinds is None or k in self._kinds]
        self._pid_kinds = _na_kinds()
        self._fed: dict[tuple, list] = {}  # (kind, filter items) -> [count, pids]

    def add(self, idx: Index) -> None:
        ours = self._kinds
        for k, evs in idx.by_kind.items():
            if not evs or (ours is not None and k not in ours):
                continue
            self._n[k] = self._n.get(k, 0) + len(evs)
            if k in self._pid_kinds:
                self._pids.setdefault(k, set()).update(map(dict.get, evs, repeat("pid")))
            if k in self._whole:
                self._whole[k].extend(evs)
            if k in RUNNER_KINDS:
                self._runners.update(map(dict.get, evs, repeat("runner")))
        for k, filt in self._feeds:
            evs = matching(idx.by_kind.get(k, []), filt)
            c = self._fed.setdefault((k, tuple(sorted(filt.items()))), [0, set()])
            c[0] += len(evs)
            c[1].update(map(dict.get, evs, repeat("pid")))

    def kind(self, k: str) -> list:
        return self._whole[k]

    def runner_values(self) -> set:
        return set(self._runners)

    def pids(self, kind: str) -> set:
        assert kind in self._pid_kinds, kind
        return set(self._pids.get(kind, ()))

    def count(self, kind: str, filt: dict[str, Any]) -> tuple[int, set]:
        n, pids = self._fed.get((kind, tuple(sorted(filt.items()))), (0, set()))
        return n, set(pids)

    def has(self, kind: str) -> bool:
        return bool(self._n.get(kind))

    def n_events(self) -> int:
        return sum(self._n.values())

    def merge(self, other: "Summary") -> None:
        """Add what ``other`` gathered (over other kinds of the same trace: ``check -j``)."""
        for k, evs in other._whole.items():
            self._whole[k].extend(evs)
        for k, n in other._n.items():
            self._n[k] = self._n.get(k, 0) + n
        for k, pids in other._pids.items():
            self._pids.setdefault(k, set()).update(pids)
        self._runners |= other._runners
        for key, (n, pids) in other._fed.items():
            c = self._fed.setdefault(key, [0, set()])
            c[0] += n
            c[1].update(pids)


def natural_key(s: Any) -> tuple:
    """req-2 before req-10 (the ids an unknown --request suggests)."""
    return tuple((0, int(x)) if x.isdigit() else (1, x) for x in re.split(r"(\d+)", str(s)))


PAIR_KINDS = tuple(k.name for k in schema.KINDS.values() if any(f.name == "remote_req" for f in k.fields))


def pair_of(events: Any, request: str) -> set[str]:
    """The other side of ``request``'s P/D pair: the ids that events of ``PAIR_KINDS`` join to
    it through ``remote_req`` (D's request -> P's, or P's -> D's in push mode)."""
    out = set()
    for e in events:
        other = e.get("remote_req")
        if other == request:
            out.add(e["req"])
        elif other and e.get("req") == request:
            out.add(other)
    out.discard(None)
    out.discard(request)
    return out


class RequestSeen:
    """Whether ``--request`` names a request of the trace, a few request ids to suggest, and the
    other side of its P/D pair (``pair``: a user may name P's id or D's; the findings of both
    sides are about the one request the client sent)."""

    def __init__(self, request: str | None):
        self.request = request
        self.seen = request is None
        self.known: list[str] = []
        self.pair: set[str] = set()

    def wanted(self) -> set[str]:
        return {self.request, *self.pair} if self.request is not None else set()

    def add(self, idx: Index) -> None:
        r = self.request
        if r is None:
            return
        for kind in PAIR_KINDS:
            if kind in idx.by_kind:
                self.pair |= pair_of(idx.by_kind[kind], r)
        if self.seen:
            return
        self.seen = any(e.get("req") == r or e.get("remote_req") == r for e in idx.events)
        # the trace's request ids: what --request may have meant (a prefix, the client's id, a near miss)
        self._know(e["req"] for e in idx.by_kind.get("req.add", ()) if e.get("req"))

    def _know(self, reqs: Any) -> None:
        self.known = sorted({*self.known, *reqs}, key=natural_key)

    def merge(self, other: "RequestSeen") -> None:
        self.seen = self.seen or other.seen
        self.pair |= other.pair
        self._know(other.known)


class Result:
    """What a streamed check read: the trace's header, footer, problems and event count,
    the findings (sorted as ``run_all`` sorts them), and the coverage facts."""

    def __init__(self, path: str):
        self.path = path
        self.header: dict[str, Any] = {}
        self.footer: dict[str, Any] | None = None
        self.problems: list[Problem] = []
        self.n_events = 0
        self.findings: list[Finding] = []
        self.notes: dict[str, list] = {}  # detector -> its facts for the report (a Stream's ``notes()``)
        self.summary = Summary()
        self.request: RequestSeen | None = None
        self.observed: Any = None  # run(observe=...)'s callback of the pass that finished
        self.jobs = 1  # the processes whose parts make this result (``detectors.parallel``)
        self.gap_after: int | None = None  # the last event id before a skipped .zst gap (``scan_segments``)

    @property
    def complete(self) -> bool:
        return is_complete(self.footer, self.problems)


_Retry = Rescan  # read the file again through scan


def run(path: str, *, only: list[str] | tuple = (), request: str | None = None, lenient: bool = False,
        progress: ProgressFn | None = None, size: int = SEGMENT,
        observe: Callable[[], Callable[[Index], None]] | None = None, fast: bool = True,
        header: dict[str, Any] | None = None) -> Result:
    """Stream the detectors of ``only`` (all when empty) over the trace at ``path``.
    ``observe``, when given, makes a callback that sees each segment's ``Index`` after the
    detectors (the report's first pass gathers its totals so); it is made again when the
    file is read a second time through ``scan``. ``fast=False``: through ``scan`` at once
    (the caller's fast pass already met what only scan judges). ``header``: line 1 as
    ``read_header`` gave it (``detectors.checking`` reads it once)."""
    was_enabled = gc.isenabled()
    gc.disable()  # the live state holds no cycles; a segment's garbage is freed by refcount
    try:
        if fast:
            try:
                return _run(path, only, request, lenient, progress, size, True, observe, header=header)
            except _Retry:
                pass
        return _run(path, only, request, lenient, progress, size, False, observe, header=header)
    finally:
        if was_enabled:
            gc.enable()


HELD_KEPT = 1 << 15  # block lists kept for schema v2 derivation (requests whose frees were not recorded)
_held_key = itemgetter("pid", "inst", "req")
_block_ids = itemgetter("block_ids")


def _derive_segment(idx: Index, whole: bool, held: dict[tuple, list]) -> None:
    """``trace.derive_block_lists`` for a segment: ``held`` (each request's latest list)
    carries over between segments; a request freed on its instance (``sched.free``) lets
    its list go. A segment whose allocations all carry their whole list (``whole``) only
    updates ``held``, at C level."""
    allocs = idx.by_kind.get("sched.alloc")
    if allocs:
        if whole and False not in map(dict.get, allocs, repeat("ok")):
            held.update(zip(map(_held_key, allocs), map(_block_ids, allocs)))
        else:
            _derive(allocs, held)
    for f in idx.by_kind.get("sched.free", ()):
        held.pop((f.get("pid"), f.get("inst"), f.get("req")), None)
    if len(held) > HELD_KEPT:  # the longest held go first
        for key in list(held)[:len(held) - HELD_KEPT]:
            del held[key]


def _run(path: str, only: Any, request: str | None, lenient: bool, progress: ProgressFn | None,
         size: int, fast: bool, observe: Any = None, part: Any = None,
         header: dict[str, Any] | None = None) -> Result:
    """One pass; ``part`` (``detectors.parallel.Part``): only its lines, its detectors, its
    share of the summary (the fast path only: ``_Retry`` otherwise)."""
    res = Result(path)
    seen = res.observed = observe() if observe is not None else None
    res.request = RequestSeen(request)
    named = [(kind, cls({})) for kind, cls in STREAMS.items() if not only or kind in only]
    streams = [st for _, st in named]
    configs = Configs()
    held: dict[tuple, list] = {}  # schema v2 block lists, per (pid, inst, request)
    index: Any = Index
    if part is not None:
        res.summary, index = Summary(part.summarize), part.index
    segs = (fast_segments(path, res, lenient, progress, size, part.keep if part is not None else None, header)
            if fast else scan_segments(path, res, lenient=lenient, progress=progress, size=size, header=header))
    for seg in segs:
        try:
            idx = index(seg, configs)
            configs.add(idx.by_kind.get("sched.config", ()))
            if res.header.get("schema_version", 1) >= 2:
                _derive_segment(idx, seg.blocks_derived, held)
            res.n_events += len(seg)
            res.summary.add(idx)
            res.request.add(idx)
            for st in streams:
                st.feed(idx)
            if seen is not None:
                seen(idx)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError):
            if fast:  # a value the fast path did not type-check: scan decides
                raise _Retry from None
            raise
    for kind, st in named:
        res.findings.extend(st.finish())
        if hasattr(st, "notes"):
            res.notes[kind] = st.notes()
    if part is None:  # (a part's: once merged, parallel._merge)
        res.findings = lease_verdict.reconcile(res.findings, res.notes, res.header)
    if request is not None and part is None:  # (a part's findings are filtered once merged: ``pair``
        from . import _about                  # may be learnt in another part)
        res.findings = [f for f in res.findings if _about(f, res.request.wanted())]
    res.findings.sort(key=sort_key)
    return res
