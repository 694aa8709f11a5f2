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
from itertools import repeat
from operator import itemgetter
from typing import Any, Iterator

from .base import DRAFTER_WINDOW_OUTSIDE_ALLOCATION, SEVERITY_ERROR, Finding
from .index import build, kind_code

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


class _Keys(dict):
    def __init__(self, allocs: dict[tuple, list[Event]]):
        super().__init__()
        self._allocs = allocs

    def __missing__(self, key: tuple) -> list[tuple]:
        v = [(a["step"] if a.get("step") is not None else -1, a["id"]) for a in self._allocs.get(key, ())]
        self[key] = v
        return v

    def get(self, key, default=None):  # type: ignore[override]
        return self[key]


def _candidates(idx) -> tuple[list[tuple], dict[tuple, list[Event]]]:
    """The windows reaching past their request's allocation -- (window, alloc, group, step,
    inst, req, block size, owned blocks, capacity), one per (inst, req, step, group, start,
    end) -- and the successful sched.alloc events per (inst, req) in trace order.

    The allocation of a window is the latest successful sched.alloc of the same (inst, req)
    before it in trace order. This is the one pass over every window and allocation, so it
    does the least per event: the fields every event needs are fetched by C-level maps, the
    loop dispatches on the kind byte, and a window inside its allocation costs a few
    operations."""
    seen: set[tuple] = set()
    candidates: list[tuple] = []
    sizes_of: dict[Any, list[int]] = {}  # inst -> block size per group
    allocs: dict[tuple, list[Event]] = {}  # (inst, req) -> its successful sched.alloc so far
    allocs_get = allocs.get
    ALLOC = kind_code("sched.alloc")
    seq, codes = idx.ordered_codes(("sched.alloc", "spec.window"))
    keys = zip(map(_inst, seq), map(dict.get, seq, repeat("req")))
    for w, code, key in zip(seq, codes, keys):
        if code == ALLOC:
            if w.get("ok", True):
                lst = allocs_get(key)
                if lst is None:
                    allocs[key] = [w]
                else:
                    lst.append(w)
            continue
        lst = allocs_get(key)
        if lst is None:
            continue
        a = lst[-1]
        g = w.get("group") or 0
        blocks = a["block_ids"]
        if g >= len(blocks):
            continue
        inst = key[0]
        sizes = sizes_of.get(inst)
        if sizes is None:
            sizes = sizes_of[inst] = [int(b) for b in idx.block_sizes(inst) or [16]]
        B = sizes[g] if g < len(sizes) else sizes[-1]
        capacity = len(blocks[g]) * B
        if w["end"] <= capacity:
            continue
        req = key[1]
        step = w.get("step")
        ckey = (inst, req, step, g, w["start"], w["end"])
        if ckey in seen:  # the same window reported by another TP rank
            continue
        seen.add(ckey)
        candidates.append((w, a, g, step, inst, req, B, list(blocks[g]), capacity))
    return candidates, allocs


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


def _holders(idx, queries: list[tuple], allocs: dict[tuple, list[Event]]) -> dict[tuple, list[str]]:
    """For each (inst, block, g, at_id): the requests holding the block just before event
    at_id -- the latest successful sched.alloc of theirs before at_id lists it in group g
    (block lists are whole per event: schema v2 lists are derived by the loader), and no
    sched.free of theirs came between -- in the order of their first allocation.

    ``allocs``: the successful sched.alloc events per (inst, req) in trace order (from
    ``_candidates``). Only requests live at at_id are looked at: first allocated before it,
    and not freed for good before it (a request's last free, when no allocation of it
    follows, ends its life). A handful of queries against tens of thousands of requests
    costs a filter over their spans, not a scan of every allocation."""
    if not queries:
        return {}
    frees: dict[tuple, list[int]] = {}
    for f in idx.kind("sched.free"):
        frees.setdefault((f.get("inst"), f.get("req")), []).append(f["id"])
    never = float("inf")
    spans: dict[Any, list[tuple]] = {}  # inst -> [(first alloc id, end id, key, allocs)]
    for key, lst in allocs.items():
        fr = frees.get(key)
        end = fr[-1] if fr and fr[-1] > lst[-1]["id"] else never
        spans.setdefault(key[0], []).append((lst[0]["id"], end, key, lst))
    out: dict[tuple, list[str]] = {}
    for q in dict.fromkeys(queries):
        inst, block, g, at_id = q
        held = []
        for _first, _end, key, lst in [s for s in spans.get(inst, ()) if s[0] < at_id < s[1]]:
            a = _latest(lst, [], None, at_id)  # not None: its first allocation is before at_id
            bl = a.get("block_ids") or ()
            if g < len(bl) and block in bl[g]:
                since = a["id"]
                if not any(since < fid < at_id for fid in frees.get(key, ())):
                    held.append(key[1])
        out[q] = held
    return out


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    idx = build(events)
    if not idx.kind("spec.window"):
        return []
    candidates, allocs = _candidates(idx)
    if not candidates:
        return []
    akeys = _Keys(allocs)  # (step, id) sort keys per (inst, req), built on first use

    # The batch events of the candidates' processes before the last candidate, and the
    # candidate windows, in trace order: each window's row, and that row's earlier
    # occupants, are read backwards from the window (they are usually a few events back).
    last = max(c[0]["id"] for c in candidates)
    cand_pids = {c[0]["pid"] for c in candidates}
    replay = [e for k in _ROW_KINDS for e in idx.kind(k) if e["id"] < last and e["pid"] in cand_pids]
    n_batch = len(replay)
    replay.extend(c[0] for c in candidates)
    replay.sort(key=_by_id)
    pos_of = {id(e): i for i, e in enumerate(replay) if e["ev"] == "spec.window"} if n_batch else {}

    prepared = []
    queries: list[tuple] = []
    for cand in candidates:
        w, a, g, step, inst, req, B, owned, capacity = cand
        outside = list(range(max(w["start"], capacity), w["end"]))
        pos = pos_of.get(id(w), 0)
        row = _row_at(replay, pos, w["pid"], w.get("req", ""))
        # earlier occupants of the row, most recent first
        prev = _Lazy(q for q in _row_history(replay, pos, w["pid"], row) if q != req) if row is not None else ()
        blocks = []
        for bi in sorted({p // B for p in outside}):
            stale = None
            stale_from = None
            for q in prev:  # most recent earlier occupant of the row that had that many blocks
                qa = _latest(allocs.get((inst, q), []), akeys.get((inst, q), []), step, w["id"])
                if qa is not None and g < len(qa["block_ids"]) and bi < len(qa["block_ids"][g]):
                    stale, stale_from = qa["block_ids"][g][bi], q
                    break
            query = (inst, stale, g, w["id"]) if stale is not None else None
            if query is not None:
                queries.append(query)
            blocks.append({
                "block_index": bi, "positions": [p for p in outside if p // B == bi],
                "stale_block": stale, "stale_from_req": stale_from, "held_by": [], "shared": False,
                "_query": query,
            })
        prepared.append((cand, outside, row, blocks))
    held_map = _holders(idx, queries, allocs)
    findings: list[Finding] = []
    for cand, outside, row, blocks in prepared:
        w, a, g, step, inst, req, B, owned, capacity = cand
        for blk in blocks:
            q = blk.pop("_query")
            held = held_map.get(q, []) if q is not None else []
            blk["held_by"] = [q for q in held if q != req]
            blk["shared"] = len(held) >= 2
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
        findings.append(Finding(
            kind=DRAFTER_WINDOW_OUTSIDE_ALLOCATION, severity=SEVERITY_ERROR, req=req, step=step, inst=inst,
            event_ids=ids, title=title, explanation=expl,
            data={"group": g, "start": w["start"], "end": w["end"], "method": w["method"], "block_size": B,
                  "block_ids": owned, "capacity": capacity, "outside_positions": outside,
                  "row": row, "blocks": blocks, "alloc_event": a.get("id"),
                  "num_lookahead_tokens": a.get("num_lookahead_tokens")}))
    return findings
