"""`pdtrace merge`: the traces of several hosts (P and D) joined into one, wall clocks aligned
on the KV hand-over (``fit_clock``).

Streaming, in bounded memory (issue 22): each input is read twice, in segments
(``pdtrace.tracefile.reading``), and never held whole.

1. First pass, per input: its header and problems, its instances, the hand-over times the
   clock fit needs (four kinds, one time per request), and how far its events run out of
   wall-clock order (``w``: a recording is written in each process's monotonic order).
2. Second pass: each input's wall times shifted by its fitted offset, put in wall-clock
   order through a buffer as deep as pass 1 measured, heap-merged into the output; the
   footer is counted as the events are written.

The output is the in-memory merge's: each input stably sorted by wall time, then merged,
ties going to the earlier input (tests/test_merge.py compares them). A directory of shards
(a recording whose pdtrace was killed) is merged in memory first (``shards.merge_shard_dir``).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import operator
import os
from itertools import accumulate, repeat
from typing import Any, Iterable, Iterator

from . import schema
from .errors import PdtraceError
from .tracefile.footer import FooterCounter
from .tracefile.reading import SEGMENT, Rescan, Sink, fast_segments, read_through, scan_segments
from .record.shards import in_time_order, merge_shard_dir
from .tracefile.trace import Problem, ProgressFn
from .tracefile.writer import make_header, write_trace

_W = operator.itemgetter("w")


@dataclasses.dataclass
class ClockFit:
    offset_ns: int  # added to the second trace's wall times
    lower_ns: int | None  # feasible offsets implied by causality: [lower, upper]
    upper_ns: int | None
    pairs: int  # request-id matches used
    note: str

    @property
    def residual_ns(self) -> int | None:
        """Half the width of the feasible interval: how far the true skew can be from the fit."""
        if self.lower_ns is None or self.upper_ns is None:
            return None
        return max(0, (self.upper_ns - self.lower_ns) // 2)


CLOCK_KINDS = frozenset({"nixl.request_finished", "nixl.send_done", "nixl.remote_alloc", "nixl.read",
                         "nixl.lease_expired"})


class ClockIndex:
    """The hand-over times of one trace, fed in trace order (the latest per request wins)."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, int]] = {}

    def add(self, events: Iterable[dict[str, Any]]) -> "ClockIndex":
        out = self.times
        for e in events:
            k = e["ev"]
            if k not in CLOCK_KINDS:
                continue
            if k == "nixl.request_finished" and e.get("side") == "P":
                out.setdefault("p_finished", {})[e.get("req")] = e["w"]
            elif k == "nixl.send_done":
                out.setdefault("p_send_done", {})[e.get("req")] = e["w"]
            elif k == "nixl.remote_alloc" and e.get("remote_req"):
                out.setdefault("d_learned", {})[e["remote_req"]] = e["w"]
            elif k == "nixl.read" and e.get("remote_req"):
                out.setdefault("d_read", {})[e["remote_req"]] = e["w"]
            elif k == "nixl.lease_expired":  # (its send_done is P's lease running out, not D's read finishing)
                out.setdefault("p_expired", {})[e.get("req")] = e["w"]
        return self


def fit_clock(first: list[dict[str, Any]] | ClockIndex, second: list[dict[str, Any]] | ClockIndex) -> ClockFit:
    """Offset for ``second`` so that the KV hand-over is causal in both directions.

    P's request_finished for request X precedes D learning about X (D's nixl.remote_alloc
    naming remote_req X): w_D + off >= w_P gives a lower bound. D's read of X completing
    precedes P's send_done for X: w_D + off <= w_P gives an upper bound (not for a request whose
    lease ran out on P, nixl.lease_expired: its send_done is the expiry, D may read later). Wall clocks are
    kept (offset 0) when they already satisfy every bound; otherwise the smallest shift that
    does is applied. Works whichever of the two traces is P. Either argument may be the
    events or their ``ClockIndex``.
    """
    a = (first if isinstance(first, ClockIndex) else ClockIndex().add(first)).times
    b = (second if isinstance(second, ClockIndex) else ClockIndex().add(second)).times
    lows: list[int] = []
    highs: list[int] = []
    # second is D relative to first as P: w_b + off >= w_a  -> off >= w_a - w_b
    for p, d, sign in ((a, b, 1), (b, a, -1)):
        for req, wp in p.get("p_finished", {}).items():
            wd = d.get("d_learned", {}).get(req)
            if wd is not None:
                (lows if sign == 1 else highs).append(sign * (wp - wd))
        expired = p.get("p_expired", {})
        for req, wp in p.get("p_send_done", {}).items():
            wd = d.get("d_read", {}).get(req) if req not in expired else None
            if wd is not None:
                (highs if sign == 1 else lows).append(sign * (wp - wd))
    lower = max(lows) if lows else None
    upper = min(highs) if highs else None
    pairs = len(lows) + len(highs)
    if not pairs:
        return ClockFit(0, None, None, 0, "no request matched across the two traces: wall clocks used as recorded")
    if lower is not None and upper is not None and lower > upper:
        off = (lower + upper) // 2
        return ClockFit(off, lower, upper, pairs, "bounds disagree (clock drift during the run?): midpoint used")
    if (lower is None or lower <= 0) and (upper is None or upper >= 0):
        return ClockFit(0, lower, upper, pairs, "wall clocks consistent with every KV hand-over: no shift")
    off = lower if lower is not None and lower > 0 else upper  # type: ignore[assignment]
    return ClockFit(int(off), lower, upper, pairs, "wall clocks violated causality: shifted by the smallest amount that restores it")


class _Input:
    """One input of a merge: what the first pass learnt of it."""

    def __init__(self, path: str, fast: bool):
        self.path, self.fast = path, fast
        self.header: dict[str, Any] = {}
        self.footer: dict[str, Any] | None = None
        self.problems: list[Problem] = []
        self.clock = ClockIndex()
        self.insts: set[str] = set()
        self.late = 0  # ns: how far behind the newest wall time so far any event came
        self.newest: int | None = None
        self.events: list[dict[str, Any]] | None = None  # a shard directory, merged in memory
        self.procs: set[tuple] = set()  # (inst, pid, wall time) of each proc.start

    def see(self, seg: list[dict[str, Any]]) -> None:
        if not seg:
            return
        self.clock.add(seg)
        self.procs.update((e.get("inst"), e.get("pid"), e.get("w")) for e in seg if e["ev"] == "proc.start")
        self.insts.update(map(dict.get, seg, repeat("inst", len(seg)), repeat(schema.INST_NONE, len(seg))))
        ws = list(map(_W, seg))
        if self.newest is not None:
            ws.insert(0, self.newest)
        run = list(accumulate(ws, max))
        self.late = max(self.late, max(map(operator.sub, run, ws)))
        self.newest = run[-1]


def _segments(inp: _Input, into: Any, lenient: bool, progress: ProgressFn | None) -> Iterator[list[dict[str, Any]]]:
    if inp.events is not None:
        return iter([inp.events])
    if inp.fast:
        return fast_segments(inp.path, into, lenient, progress, SEGMENT)
    return scan_segments(inp.path, into, lenient=lenient, progress=progress, size=SEGMENT)


def _first_pass(path: str, lenient: bool, progress: ProgressFn | None) -> _Input:
    if os.path.isdir(path):
        inp = _Input(path, fast=False)
        inp.events, inp.problems = merge_shard_dir(path)
        inp.header = make_header(origin="record", cmd=[])
        inp.see(inp.events)
        return inp

    def start(fast: bool) -> tuple[_Input, Any]:
        inp = _Input(path, fast)
        return inp, inp.see
    return read_through(path, lenient, progress, start)


def _shifted(inp: _Input, offset: int, lenient: bool, progress: ProgressFn | None) -> Iterator[dict[str, Any]]:
    """The second pass over one input: its events with ``w`` shifted and without ``id``."""
    try:
        for seg in _segments(inp, Sink(), lenient, progress):
            for e in seg:
                e.pop("id", None)
                e["w"] += offset
                yield e
    except Rescan:
        raise PdtraceError(f"{inp.path}: the file changed while it was being merged") from None


def merge_traces(paths: Iterable[str], output: str, *, lenient: bool = False,
                 progress: Any = None) -> dict[str, Any]:
    """Merge the traces (or shard directories) at ``paths`` into ``output``. ``progress``,
    when given, is called as ``progress(what, path)`` and returns a ``progress(done, total)``
    callback (or None) for that pass over that file."""
    was_enabled = gc.isenabled()
    gc.disable()  # events hold no cycles: the cyclic GC would rescan millions of dicts for nothing
    try:
        return _merge([str(p) for p in paths], output, lenient, progress)
    finally:
        if was_enabled:
            gc.enable()


def _merge(paths: list[str], output: str, lenient: bool, progress: Any) -> dict[str, Any]:
    def prog(what: str, path: str) -> ProgressFn | None:
        return progress(what, path) if progress is not None and not os.path.isdir(path) else None

    inputs = [_first_pass(p, lenient, prog("reading", p)) for p in paths]
    if not inputs:
        raise PdtraceError("nothing to merge")
    base = inputs[0]
    problems: list[Problem] = []
    clock: dict[str, Any] = {"reference": os.path.basename(base.path), "traces": []}
    offsets = [0]
    for inp in inputs:
        name = os.path.basename(inp.path)
        problems += [dataclasses.replace(p, file=name) for p in inp.problems]
    for i, a in enumerate(inputs):  # the same recording twice would double every event of its processes
        for b in inputs[i + 1:]:
            same = sorted(a.procs & b.procs, key=str)
            if same:
                inst, pid, _w = same[0]
                raise PdtraceError(f"{a.path} and {b.path} hold the same process (pid {pid} of instance {inst}, "
                                   f"started at the same instant{f', and {len(same) - 1} more' if len(same) > 1 else ''}"
                                   "): the same recording given twice? Merge each host's trace once")
    for inp in inputs[1:]:
        fit = fit_clock(base.clock, inp.clock)
        offsets.append(fit.offset_ns)
        clock["traces"].append({"trace": os.path.basename(inp.path), "host": inp.header.get("host", ""),
                                "offset_ns": fit.offset_ns, "lower_ns": fit.lower_ns, "upper_ns": fit.upper_ns,
                                "residual_ns": fit.residual_ns, "pairs": fit.pairs, "note": fit.note})
    insts = sorted(set().union(*(i.insts for i in inputs)) - {schema.INST_NONE})
    origins = sorted({i.header.get("origin", "") for i in inputs})
    # A flight-recorder input keeps the merged trace a flight-recorder trace: check's ring-cut rule
    # (detectors.ringcut) needs the header's ring_s, and the widest window covers every input's.
    rings = [float(i.header["ring_s"]) for i in inputs if i.header.get("ring_s")]
    extra: dict[str, Any] = {"ring_s": max(rings)} if rings else {}
    header = make_header(origin="merge", cmd=list(base.header.get("cmd") or []),
                         redacted=all(i.header.get("redacted", True) for i in inputs),
                         versions=base.header.get("versions"), instances=insts, clock=clock,
                         merged_from=[{"trace": os.path.basename(i.path), "origin": i.header.get("origin", ""),
                                       "host": i.header.get("host", ""), "cmd": list(i.header.get("cmd") or []),
                                       **{k: i.header[k] for k in ("ring_s", "snapshot") if i.header.get(k)}}
                                      for i in inputs],
                         source_origins=origins, **extra)

    def footer(counter: FooterCounter) -> dict[str, Any]:
        f = counter.footer()
        if problems:
            f["input_problems"] = [str(p) for p in problems]
            f["lost"] = sum(p.lost for p in problems)
        return f

    streams = [in_time_order(_shifted(inp, off, lenient, prog("merging", inp.path)), inp.late, key="w")
               for inp, off in zip(inputs, offsets)]
    written = write_trace(output, header, heapq.merge(*streams, key=_W), footer)
    return {"events": written["events"], "clock": clock, "problems": problems}
