"""Joining per-process shards into one trace (P and D traces of two hosts: ``pdtrace.merge``).

A shard is ``<pid>.pdshard`` written by one process's recorder: framed batches of queued
events in marshal form (``pdtrace.record.recorder.Recorder._encode_frame``), appended by the
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

from .. import schema
from ..errors import PdtraceError
from ..tracefile.footer import FooterCounter
from .frames import SHARD_SUFFIX, iter_frames, read_frames
from .recorder import GROW, materialize
from ..tracefile.trace import Problem, make_header, write_trace


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

    streams = [in_time_order(_shard_events(sc.path), sc.lateness) for sc in scans]
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


def in_time_order(events: Iterable[dict[str, Any]], lateness: int, key: str = "t") -> Iterator[dict[str, Any]]:
    """Events sorted by ``key`` (ties in arrival order) with a buffer of ``lateness`` ns: an
    event is released once an event more than ``lateness`` newer has arrived, and no later
    arrival can be older than that (``_scan``, or the merge's first pass, measured the
    largest lateness)."""
    heap: list[tuple[int, int, dict[str, Any]]] = []
    newest = None
    for seq, e in enumerate(events):
        t = e[key]
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
