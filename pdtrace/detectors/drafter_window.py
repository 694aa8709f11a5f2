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
from typing import Any

from .base import DRAFTER_WINDOW_OUTSIDE_ALLOCATION, SEVERITY_ERROR, Finding
from .index import build

Event = dict[str, Any]

_ROW_KINDS = ("batch.add", "batch.remove", "batch.swap", "batch.condense", "spec.window")


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


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    idx = build(events)
    windows = idx.kind("spec.window")
    if not windows:
        return []

    frees: dict[tuple, list[Event]] = {}
    for f in idx.kind("sched.free"):
        frees.setdefault((f.get("inst"), f.get("req")), []).append(f)

    def holders_many(queries: list[tuple]) -> dict[tuple, list[str]]:
        """For each (inst, block, g, at_id): requests holding the block just before event at_id
        (allocated it, and not freed since). One pass over the allocations for all queries."""
        got: dict[tuple, dict[str, int]] = {q: {} for q in queries}
        if not queries:
            return {}
        last = max(q[3] for q in queries)
        for a in idx.kind("sched.alloc"):
            aid = a["id"]
            if aid >= last:
                break
            bl = a["block_ids"]
            for q in queries:
                inst, block, g, at_id = q
                if aid < at_id and g < len(bl) and block in bl[g] and a.get("inst") == inst:
                    got[q].setdefault(a.get("req"), aid)
        out: dict[tuple, list[str]] = {}
        for q, reqs in got.items():
            inst, _block, _g, at_id = q
            out[q] = [r for r, since in reqs.items()
                      if not any(since < f["id"] < at_id for f in frees.get((inst, r), ()))]
        return out

    seen: set[tuple] = set()
    candidates = []
    sizes_of: dict[Any, list[int]] = {}
    latest_alloc: dict[tuple, Event] = {}  # (inst, req) -> last sched.alloc so far (trace order)
    for w in idx.ordered(("sched.alloc", "spec.window")):
        inst, req = w["inst"], w.get("req")
        if w["ev"] == "sched.alloc":
            if w.get("ok", True):
                latest_alloc[(inst, req)] = w
            continue
        a = latest_alloc.get((inst, req))
        if a is None:
            continue
        g = w.get("group") or 0
        blocks = a["block_ids"]
        if g >= len(blocks):
            continue
        sizes = sizes_of.get(inst)
        if sizes is None:
            sizes = sizes_of[inst] = idx.block_sizes(inst) or [16]
        B = int(sizes[g] if g < len(sizes) else sizes[-1])
        capacity = len(blocks[g]) * B
        if w["end"] <= capacity:
            continue
        step = w.get("step")
        key = (inst, req, step, g, w["start"], w["end"])
        if key in seen:  # the same window reported by another TP rank
            continue
        seen.add(key)
        candidates.append((w, a, g, step, inst, req, B, list(blocks[g]), capacity))
    if not candidates:
        return []
    # allocations per (inst, req), ordered by (step, id)
    allocs: dict[tuple, list[Event]] = {}
    for a in idx.kind("sched.alloc"):
        if a.get("ok", True):
            allocs.setdefault((a.get("inst"), a.get("req")), []).append(a)
    akeys = _Keys(allocs)  # (step, id) sort keys per (inst, req), built on first use

    # row history per worker process, replayed in trace order up to each window
    row_hist: dict[Any, dict[int, list[str]]] = {}  # pid -> row -> occupants in order
    req_row: dict[Any, dict[str, int]] = {}
    window_rows: dict[int, tuple[int | None, list[str]]] = {}  # id(window) -> (row, previous occupants)
    last = max(c[0]["id"] for c in candidates)
    cand_pids = {c[0]["pid"] for c in candidates}
    replay = [e for k in _ROW_KINDS[:-1] for e in idx.kind(k) if e["id"] < last and e["pid"] in cand_pids]
    replay.extend(c[0] for c in candidates)  # only the windows that need a row
    replay.sort(key=lambda e: e["id"])
    for e in replay:
        pid = e["pid"]
        k = e["ev"]
        hist = row_hist.setdefault(pid, {})
        rows = req_row.setdefault(pid, {})
        if k == "batch.add":
            hist.setdefault(e["row"], []).append(e.get("req", ""))
            rows[e.get("req", "")] = e["row"]
        elif k == "batch.remove":
            rows.pop(e.get("req", ""), None)
        elif k == "batch.swap":
            for r_from, r_to, q in ((e["i1"], e["i2"], e["req1"]), (e["i2"], e["i1"], e["req2"])):
                if q:
                    rows[q] = r_to
                    hist.setdefault(r_to, []).append(q)
        elif k == "batch.condense":
            for q, _old, new in e["moves"]:
                rows[q] = new
                hist.setdefault(new, []).append(q)
        else:  # spec.window
            r = rows.get(e.get("req", ""))
            window_rows[id(e)] = (r, len(hist.get(r, ())) if r is not None else 0)  # history length so far

    prepared = []
    queries: list[tuple] = []
    for cand in candidates:
        w, a, g, step, inst, req, B, owned, capacity = cand
        outside = list(range(max(w["start"], capacity), w["end"]))
        row, n_hist = window_rows.get(id(w), (None, 0))
        prev = [q for q in row_hist.get(w["pid"], {}).get(row, [])[:n_hist] if q != req] if row is not None else []
        blocks = []
        for bi in sorted({p // B for p in outside}):
            stale = None
            stale_from = None
            for q in reversed(prev):  # most recent earlier occupant of the row that had that many blocks
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
    held_map = holders_many(queries)
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
