"""drafter-window-outside-allocation (vLLM thread 003).

DFlash's drafter writes KV for k+1 positions past the prompt right after the first
prefill; when the scheduler reserved no / too few lookahead slots those positions fall
in blocks the request does not own, e.g. shared prefix-cache blocks of other requests.

For each ``spec.window [start, end)`` the request's allocation at that step is the latest
``sched.alloc`` for it on the same instance; it covers ``len(block_ids[g]) * block_size``
positions. Positions at or past that are outside. Where the trace shows the request's
InputBatch row history (``batch.*``), the block-table entry such a position would use is
the stale entry left by an earlier occupant of the row; the finding names that block and
the requests that hold it at that step (two or more holders = a shared prefix-cache block).
"""

from __future__ import annotations

import bisect
from itertools import islice, repeat
from operator import itemgetter
from typing import Any, Iterator

from .base import DRAFTER_WINDOW_OUTSIDE_ALLOCATION, SEVERITY_ERROR, Finding
from .index import feed_all, kind_code

Event = dict[str, Any]

_ROW_KINDS = ("batch.add", "batch.remove", "batch.swap", "batch.condense")
_by_id = itemgetter("id")
_inst = itemgetter("inst")


def _latest(items: list[Event], keys: list[tuple], step: int | None, at_id: int) -> Event | None:
    """The last item at or before ``step`` (or, without a step, emitted before event ``at_id``)."""
    if step is not None:
        i = bisect.bisect_right(keys, (step, 1 << 62))
        return items[i - 1] if i else None
    best = None
    for it in items:
        if it["id"] < at_id:
            best = it
    return best


def _row_at(replay: list[Event], pos: int, pid: Any, req: Any) -> Any:
    """The InputBatch row of ``req`` in process ``pid`` just before ``replay[pos]``: the effect
    of the last batch event before it that placed or removed the request (None if none)."""
    for j in range(pos - 1, -1, -1):
        e = replay[j]
        if e["pid"] != pid:
            continue
        k = e["ev"]
        if k == "batch.condense":
            for q, _old, new in reversed(e["moves"]):
                if q == req:
                    return new
        elif k == "batch.add":
            if e.get("req", "") == req:
                return e["row"]
        elif k == "batch.remove":
            if e.get("req", "") == req:
                return None
        elif k == "batch.swap":  # applied as (i1 -> i2, req1) then (i2 -> i1, req2)
            if e["req2"] and e["req2"] == req:
                return e["i1"]
            if e["req1"] and e["req1"] == req:
                return e["i2"]
    return None


def _row_history(replay: list[Event], pos: int, pid: Any, row: Any) -> Iterator[Any]:
    """The requests placed in ``row`` of process ``pid`` before ``replay[pos]``, most recent
    first (a request once per placement)."""
    for j in range(pos - 1, -1, -1):
        e = replay[j]
        if e["pid"] != pid:
            continue
        k = e["ev"]
        if k == "batch.condense":
            for q, _old, new in reversed(e["moves"]):
                if new == row:
                    yield q
        elif k == "batch.add":
            if e["row"] == row:
                yield e.get("req", "")
        elif k == "batch.swap":  # applied as (i1 -> i2, req1) then (i2 -> i1, req2)
            if e["i1"] == row and e["req2"]:
                yield e["req2"]
            if e["i2"] == row and e["req1"]:
                yield e["req1"]


class _Lazy:
    """A list filled from an iterator as far as it is read."""

    def __init__(self, it: Iterator[Any]):
        self._it = it
        self.items: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        items = self.items
        i = 0
        while True:
            if i < len(items):
                yield items[i]
            else:
                nxt = next(self._it, _Lazy)
                if nxt is _Lazy:
                    return
                items.append(nxt)
                yield nxt
            i += 1


# Bounds on what a stream keeps: the latest allocations per request, the requests freed
# most recently per instance (earlier occupants of a row), and each process's row changes.
ALLOCS_KEPT = 2  # (``live`` / ``freed`` entries: [first allocation id, previous, latest])
LIVE_KEPT = 16384  # live requests per instance (a trace whose frees were not recorded)
FREED_KEPT = 4096
ROW_EVENTS_KEPT = 8192


class Stream:
    """The detector over events fed in trace order (``feed`` one ``Index`` of consecutive
    events at a time, then ``finish``).

    A window is judged when it is read, against the state at that point of the trace: the
    latest successful ``sched.alloc`` of its request; the row it sits in, from the process's
    ``batch.*`` history; that row's earlier occupants and their allocations at the window's
    step; and the requests holding the stale block (live: allocated, not freed since). It
    keeps the last ``ALLOCS_KEPT`` allocations of each live request (at most ``LIVE_KEPT``
    per instance, a quarter more between trims: beyond that the oldest count as freed) and
    of the ``FREED_KEPT`` requests freed last per instance (likewise), and the last
    ``ROW_EVENTS_KEPT`` row changes per process."""

    KINDS = ("sched.alloc", "spec.window", "sched.free", *_ROW_KINDS)

    def __init__(self, header: dict | None = None):
        self.live: dict[Any, dict[Any, list]] = {}  # inst -> req -> [first alloc id, previous, latest]
        self.freed: dict[Any, dict[Any, list]] = {}  # inst -> req -> the same, freed (oldest first)
        self.rows: dict[Any, list[Event]] = {}  # pid -> batch events in trace order
        self.seen: set[tuple] = set()
        self.sizes_of: dict[Any, list[int]] = {}  # inst -> block size per group
        self.findings: list[Finding] = []

    def feed(self, idx: Any) -> None:
        if not any(idx.kind(k) for k in self.KINDS):
            return
        ALLOC, WINDOW, FREE = kind_code("sched.alloc"), kind_code("spec.window"), kind_code("sched.free")
        live, freed, rows, sizes_of = self.live, self.freed, self.rows, self.sizes_of
        live_get = live.get
        seq, codes = idx.ordered_codes(self.KINDS)
        keys = zip(map(_inst, seq), map(dict.get, seq, repeat("req")))
        for w, code, (inst, req) in zip(seq, codes, keys):
            if code == ALLOC:
                if w.get("ok", True):
                    reqs = live_get(inst)
                    if reqs is None:
                        reqs = live[inst] = {}
                    ent = reqs.get(req)
                    if ent is None:
                        ent = freed.get(inst, {}).pop(req, None) or [w["id"], None, None]
                        reqs[req] = ent
                        if len(reqs) > LIVE_KEPT + LIVE_KEPT // 4:  # the oldest are taken as freed
                            reqs = self._trim_live(inst)
                    ent[1] = ent[2]
                    ent[2] = w
                continue
            if code == FREE:
                self._free(inst, req)
                continue
            if code != WINDOW:  # batch.*
                lst = rows.get(w["pid"])
                if lst is None:
                    rows[w["pid"]] = [w]
                else:
                    lst.append(w)
                    if len(lst) > 2 * ROW_EVENTS_KEPT:
                        del lst[:ROW_EVENTS_KEPT]
                continue
            reqs = live_get(inst)
            ent = reqs.get(req) if reqs is not None else None
            if ent is None:
                ent = freed.get(inst, {}).get(req)
                if ent is None:
                    continue
            a = ent[2]
            g = w.get("group") or 0
            blocks = a["block_ids"]
            if g >= len(blocks):
                continue
            sizes = sizes_of.get(inst)
            if sizes is None:
                sizes = sizes_of[inst] = [int(b) for b in idx.block_sizes(inst) or [16]]
            B = sizes[g] if g < len(sizes) else sizes[-1]
            capacity = len(blocks[g]) * B
            if w["end"] <= capacity or w["start"] >= w["end"]:  # (an empty window writes nothing)
                continue
            step = w.get("step")
            ckey = (inst, req, step, g, w["start"], w["end"])
            if ckey in self.seen:  # the same window reported by another TP rank
                continue
            self.seen.add(ckey)
            self.findings.append(self._judge(w, a, g, step, inst, req, B, list(blocks[g]), capacity))

    def _trim_live(self, inst: Any) -> dict:
        """Back to the latest ``LIVE_KEPT`` live requests of ``inst``, the older ones freed
        (a fresh table: no deleted slots left before the oldest)."""
        reqs = self.live[inst]
        for q in list(islice(reqs, len(reqs) - LIVE_KEPT)):
            self._free(inst, q)
        reqs = self.live[inst] = dict(reqs)
        return reqs

    def _free(self, inst: Any, req: Any) -> None:
        ent = self.live.get(inst, {}).pop(req, None)
        if ent is not None:
            gone = self.freed.setdefault(inst, {})
            gone[req] = ent
            if len(gone) > FREED_KEPT + FREED_KEPT // 4:  # back to the latest FREED_KEPT, now and then
                # (deleting the oldest one at a time leaves deleted slots that each next lookup
                # of the oldest walks over)
                self.freed[inst] = dict(islice(gone.items(), len(gone) - FREED_KEPT, None))

    def _alloc_of(self, inst: Any, q: Any, step: int | None, at_id: int) -> Event | None:
        """Request ``q``'s latest allocation at or before ``step`` (before ``at_id`` without one)."""
        ent = self.live.get(inst, {}).get(q) or self.freed.get(inst, {}).get(q)
        if ent is None:
            return None
        items = [x for x in ent[1:] if x is not None]
        return _latest(items, [(x["step"] if x.get("step") is not None else -1, x["id"]) for x in items],
                       step, at_id)

    def _holders(self, inst: Any, block: Any, g: int) -> list[str]:
        """The live requests whose latest allocation lists ``block`` in group ``g``, in the
        order of their first allocation."""
        held = []
        for q, ent in self.live.get(inst, {}).items():
            bl = ent[2].get("block_ids") or ()
            if g < len(bl) and block in bl[g]:
                held.append((ent[0], q))
        return [q for _first, q in sorted(held, key=lambda x: x[0])]

    def _judge(self, w: Event, a: Event, g: int, step: int | None, inst: Any, req: Any, B: int,
               owned: list[int], capacity: int) -> Finding:
        outside = list(range(max(w["start"], capacity), w["end"]))
        replay = [*self.rows.get(w["pid"], ()), w]
        pos = len(replay) - 1
        row = _row_at(replay, pos, w["pid"], w.get("req", ""))
        # earlier occupants of the row, most recent first
        prev = _Lazy(q for q in _row_history(replay, pos, w["pid"], row) if q != req) if row is not None else ()
        blocks = []
        for bi in sorted({p // B for p in outside}):
            stale = None
            stale_from = None
            for q in prev:  # most recent earlier occupant of the row that had that many blocks
                qa = self._alloc_of(inst, q, step, w["id"])
                if qa is not None and g < len(qa["block_ids"]) and bi < len(qa["block_ids"][g]):
                    stale, stale_from = qa["block_ids"][g][bi], q
                    break
            held = self._holders(inst, stale, g) if stale is not None else []
            blocks.append({
                "block_index": bi, "positions": [p for p in outside if p // B == bi],
                "stale_block": stale, "stale_from_req": stale_from, "held_by": [q for q in held if q != req],
                "shared": len(held) >= 2,
            })
        return _finding(w, a, g, step, inst, req, B, owned, capacity, outside, row, blocks)

    def finish(self) -> list[Finding]:
        return self.findings


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


def _finding(w: Event, a: Event, g: int, step: int | None, inst: Any, req: Any, B: int, owned: list[int],
             capacity: int, outside: list[int], row: Any, blocks: list[dict]) -> Finding:
    ids = sorted({e["id"] for e in (w, a) if "id" in e})
    where = []
    for b in blocks:
        if b["stale_block"] is None:
            where.append(f"block index {b['block_index']} (no block owned; the block-table entry is stale or padding)")
        else:
            who = (f"held by {b['held_by']}" + (" (shared prefix-cache block)" if b["shared"] else "")) \
                if b["held_by"] else "not held by any live request"
            where.append(f"block index {b['block_index']} -> stale entry block {b['stale_block']} "
                         f"(left by {b['stale_from_req']}, {who})")
    title = (f"request {req} step {step}: {w['method']} drafter writes positions {outside[0]}..{outside[-1]} "
             f"outside its {len(owned)} block(s) ({capacity} slots)")
    expl = (
        f"At step {step} on {inst} the {w['method']} drafter's KV write window for {req} is "
        f"[{w['start']}, {w['end']}) in group {g}, but the request holds only blocks {owned} "
        f"(block size {B}, {capacity} positions; sched.alloc event {a.get('id')} asked for "
        f"{a.get('num_lookahead_tokens')} lookahead token(s), scheduler lookahead "
        f"{a.get('sched_lookahead_tokens')}). {len(outside)} position(s) {outside} fall outside: "
        + "; ".join(where)
        + ". The drafter writes KV into blocks the request does not own, corrupting them for their owners "
        "(or the prefix cache). Reserve num_spec_tokens+1 lookahead slots for this method."
    )
    return Finding(
        kind=DRAFTER_WINDOW_OUTSIDE_ALLOCATION, severity=SEVERITY_ERROR, req=req, step=step, inst=inst,
        event_ids=ids, title=title, explanation=expl,
        data={"group": g, "start": w["start"], "end": w["end"], "method": w["method"], "block_size": B,
              "block_ids": owned, "capacity": capacity, "outside_positions": outside,
              "row": row, "blocks": blocks, "alloc_event": a.get("id"),
              "num_lookahead_tokens": a.get("num_lookahead_tokens")})
