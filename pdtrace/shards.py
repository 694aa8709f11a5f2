"""Joining per-process shards into one trace, and joining P and D traces from two hosts.

A shard is ``<pid>.pdshard`` written by one process's recorder: framed batches of queued
events in marshal form (``pdtrace.recorder.Recorder._encode_frame``), appended by the
writer thread; events only, no header or footer. A process killed with SIGKILL may leave a
cut last frame, a failed write a cut frame in the middle: each damaged frame is skipped and
reported (with the events it held), every intact frame before and after it is kept. JSON-lines shards
(``<pid>.jsonl``, one event object per line) are read too.
"""

from __future__ import annotations

import dataclasses
import glob
import heapq
import operator
import os
from typing import Any, Iterable, Iterator

import orjson

from . import schema
from .errors import PdtraceError
from .footer import FooterCounter
from .frames import SHARD_SUFFIX, iter_frames, read_frames
from .recorder import GROW, materialize
from .trace import Problem, load, make_footer, make_header, write_trace


def read_shard(path: str) -> tuple[list[dict[str, Any]], list[Problem]]:
    if path.endswith(SHARD_SUFFIX):
        frames, problems = read_frames(path)
        events = [e for meta, items in frames for e in materialize(meta, items)]
        events.sort(key=lambda e: e["t"])  # several threads of one process may interleave
        return events, problems
    problems = []
    events = list(_jsonl_events(path, problems))
    events.sort(key=lambda e: e["t"])  # several threads of one process may interleave
    return events, problems


def shard_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*" + SHARD_SUFFIX))
                  + glob.glob(os.path.join(directory, "*.jsonl")))


def merge_shard_dir(directory: str) -> tuple[list[dict[str, Any]], list[Problem]]:
    """All events of a shard directory in time order (one host: CLOCK_MONOTONIC is shared)."""
    files = shard_files(directory)
    if not files:
        raise PdtraceError(f"{directory}: no shard files (*{SHARD_SUFFIX} or *.jsonl) in this directory")
    per: list[list[dict[str, Any]]] = []
    problems: list[Problem] = []
    for f in files:
        ev, pr = read_shard(f)
        per.append(ev)
        problems.extend(pr)
    merged = list(heapq.merge(*per, key=lambda e: e["t"]))
    return merged, problems


def finalize_session(directory: str, output: str, *, cmd: list[str], redacted: bool,
                     exit_code: int | None, ring_s: float | None = None,
                     snapshot: str | None = None) -> tuple[dict[str, Any], list[Problem]]:
    """Merge a recording's shards into one trace file, streaming: memory is bounded by one
    frame per shard plus the events a shard holds out of time order (``_scan``), not by the
    length of the recording."""
    files = shard_files(directory)
    if not files:
        raise PdtraceError(f"{directory}: no shard files (*{SHARD_SUFFIX} or *.jsonl) in this directory")
    scans = [_scan(f) for f in files]
    problems = [p for sc in scans for p in sc.problems]
    insts = sorted(set().union(*(sc.insts for sc in scans)) - {schema.INST_NONE})
    extra: dict[str, Any] = {}
    if ring_s:
        extra["ring_s"] = float(ring_s)
    if snapshot:
        extra["snapshot"] = snapshot
    header = make_header(origin="record", cmd=cmd, redacted=redacted, instances=insts, **extra)

    def footer(counter: FooterCounter) -> dict[str, Any]:
        f = counter.footer(exit_code=exit_code)
        if problems:
            f["shard_problems"] = [str(p) for p in problems]
            f["lost"] = sum(p.lost for p in problems)
        return f

    streams = [_in_time_order(_shard_events(sc.path), sc.lateness) for sc in scans]
    written = write_trace(output, header, heapq.merge(*streams, key=_T), footer)
    return written, problems


_T = operator.itemgetter("t")


@dataclasses.dataclass
class _Scan:
    path: str
    insts: set[str]
    lateness: int  # ns: how far behind the newest event seen so far any event of the shard came
    problems: list[Problem]


def _scan(path: str) -> _Scan:
    """First pass over one shard, without building events: its instances, its problems, and
    its lateness (several threads of one process queue events a little out of time order)."""
    insts: set[str] = set()
    newest, late = None, 0

    def see(t: int) -> None:
        nonlocal newest, late
        if newest is None or t > newest:
            newest = t
        elif newest - t > late:
            late = newest - t

    problems: list[Problem] = []
    if path.endswith(SHARD_SUFFIX):
        for meta, items in iter_frames(path, problems):
            insts.add(meta[2])
            for _kind, t, _req, _step, fields in items:
                if "inst" in fields:
                    insts.add(fields["inst"])
                grow = fields.get(GROW)
                if grow is not None:
                    see(grow[0])
                see(t)
    else:
        for e in _jsonl_events(path, problems):
            insts.add(e.get("inst", schema.INST_NONE))
            see(e["t"])
    return _Scan(path, insts, late, problems)


def _shard_events(path: str) -> Iterator[dict[str, Any]]:
    if path.endswith(SHARD_SUFFIX):
        for meta, items in iter_frames(path, []):  # problems were counted by _scan
            yield from materialize(meta, items)
    else:
        yield from _jsonl_events(path, [])


def _in_time_order(events: Iterable[dict[str, Any]], lateness: int) -> Iterator[dict[str, Any]]:
    """Events sorted by ``t`` (ties in arrival order) with a buffer of ``lateness`` ns: an
    event is released once an event more than ``lateness`` newer has arrived, and no later
    arrival can be older than that (``_scan`` measured the largest lateness)."""
    heap: list[tuple[int, int, dict[str, Any]]] = []
    newest = None
    for seq, e in enumerate(events):
        t = e["t"]
        heapq.heappush(heap, (t, seq, e))
        if newest is None or t > newest:
            newest = t
        while heap[0][0] < newest - lateness:
            yield heapq.heappop(heap)[2]
    while heap:
        yield heapq.heappop(heap)[2]


def _jsonl_events(path: str, problems: list[Problem]) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                why = ("truncated last line (process killed mid-write)" if not raw.endswith(b"\n")
                       else "corrupt line: not valid JSON")
                problems.append(Problem(n, f"{os.path.basename(path)}: {why}"))
                continue
            if not isinstance(obj, dict) or "ev" not in obj or not isinstance(obj.get("t"), int):
                problems.append(Problem(n, f"{os.path.basename(path)}: not an event"))
                continue
            yield obj


# --------------------------------------------------------------------------------------
# joining traces of two hosts (P and D)
# --------------------------------------------------------------------------------------

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


def fit_clock(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> ClockFit:
    """Offset for ``second`` so that the KV hand-over is causal in both directions.

    P's request_finished for request X precedes D learning about X (D's nixl.remote_alloc
    naming remote_req X): w_D + off >= w_P gives a lower bound. D's read of X completing
    precedes P's send_done for X: w_D + off <= w_P gives an upper bound. Wall clocks are
    kept (offset 0) when they already satisfy every bound; otherwise the smallest shift that
    does is applied. Works whichever of the two traces is P.
    """
    def index(events: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for e in events:
            k = e["ev"]
            if k == "nixl.request_finished" and e.get("side") == "P":
                out.setdefault("p_finished", {})[e.get("req")] = e["w"]
            elif k == "nixl.send_done":
                out.setdefault("p_send_done", {})[e.get("req")] = e["w"]
            elif k == "nixl.remote_alloc" and e.get("remote_req"):
                out.setdefault("d_learned", {})[e["remote_req"]] = e["w"]
            elif k == "nixl.read" and e.get("remote_req"):
                out.setdefault("d_read", {})[e["remote_req"]] = e["w"]
        return out

    a, b = index(first), index(second)
    lows: list[int] = []
    highs: list[int] = []
    # second is D relative to first as P: w_b + off >= w_a  -> off >= w_a - w_b
    for p, d, sign in ((a, b, 1), (b, a, -1)):
        for req, wp in p.get("p_finished", {}).items():
            wd = d.get("d_learned", {}).get(req)
            if wd is not None:
                (lows if sign == 1 else highs).append(sign * (wp - wd))
        for req, wp in p.get("p_send_done", {}).items():
            wd = d.get("d_read", {}).get(req)
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


def _load_any(path: str, lenient: bool) -> tuple[dict[str, Any], list[dict[str, Any]], list[Problem]]:
    if os.path.isdir(path):
        ev, pr = merge_shard_dir(path)
        return make_header(origin="record", cmd=[]), ev, pr
    tr = load(path, lenient=lenient)
    return tr.header, tr.events, tr.problems


def merge_traces(paths: Iterable[str], output: str, *, lenient: bool = False) -> dict[str, Any]:
    loaded = [(p, *_load_any(str(p), lenient)) for p in paths]
    if not loaded:
        raise PdtraceError("nothing to merge")
    base_path, base_header, base_events, problems = loaded[0]
    streams = [base_events]
    clock: dict[str, Any] = {"reference": os.path.basename(str(base_path)), "traces": []}
    for path, header, events, pr in loaded[1:]:
        problems = problems + pr
        fit = fit_clock(base_events, events)
        for e in events:
            e["w"] += fit.offset_ns
        clock["traces"].append({"trace": os.path.basename(str(path)), "host": header.get("host", ""),
                                "offset_ns": fit.offset_ns, "lower_ns": fit.lower_ns, "upper_ns": fit.upper_ns,
                                "residual_ns": fit.residual_ns, "pairs": fit.pairs, "note": fit.note})
        streams.append(events)
    for s in streams:
        s.sort(key=lambda e: e["w"])
    merged = list(heapq.merge(*streams, key=lambda e: e["w"]))
    for e in merged:
        e.pop("id", None)
    insts = sorted({e.get("inst", schema.INST_NONE) for e in merged} - {schema.INST_NONE})
    origins = sorted({h.get("origin", "") for _p, h, _e, _pr in loaded})
    # A flight-recorder input keeps the merged trace a flight-recorder trace: check's ring-cut rule
    # (detectors.ringcut) needs the header's ring_s, and the widest window covers every input's.
    rings = [float(h["ring_s"]) for _p, h, _e, _pr in loaded if h.get("ring_s")]
    extra: dict[str, Any] = {"ring_s": max(rings)} if rings else {}
    header = make_header(origin="merge", cmd=list(base_header.get("cmd") or []),
                         redacted=all(h.get("redacted", True) for _p, h, _e, _pr in loaded),
                         versions=base_header.get("versions"), instances=insts, clock=clock,
                         merged_from=[{"trace": os.path.basename(str(p)), "origin": h.get("origin", ""),
                                       "host": h.get("host", ""), "cmd": list(h.get("cmd") or []),
                                       **{k: h[k] for k in ("ring_s", "snapshot") if h.get(k)}}
                                      for p, h, _e, _pr in loaded],
                         source_origins=origins, **extra)
    footer = make_footer(merged)
    if problems:
        footer["input_problems"] = [str(p) for p in problems]
        footer["lost"] = sum(p.lost for p in problems)
    write_trace(output, header, merged, footer)
    return {"events": len(merged), "clock": clock, "problems": problems}
