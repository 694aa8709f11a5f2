"""The drafter's KV write windows of a request (``spec.window``), laid over its allocation.

For each window ``[start, end)`` the allocation is the request's latest successful
``sched.alloc`` on the same instance before the window (as detectors/drafter_window.py
reads it); the block index of position ``p`` is ``p // block_size``. Positions at or past
``len(blocks) * block_size`` are outside the allocation. What such a position would
overwrite (the stale block-table entry, the requests holding that block, a shared
prefix-cache block) is what the detector found; it is taken from its finding's ``data``.
No Textual imports.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from pdtrace.index.trace_index import TraceIndex
from pdtrace.tracefile.trace import derive_block_lists

WINDOW_KIND = "drafter-window-outside-allocation"
MAX_WINDOWS = 20


@dataclasses.dataclass
class WindowBlock:
    index: int  # block index in the request's block table
    block: int | None  # block id the request owns there (None: not allocated)
    lo: int  # first position the block index covers
    hi: int  # last position it covers
    writes: list[int]  # window positions that fall in it
    stale_block: int | None = None  # block an outside write would hit (from the finding)
    stale_from: str | None = None  # the earlier row occupant that left that entry
    held_by: list[str] = dataclasses.field(default_factory=list)
    shared: bool = False

    @property
    def owned(self) -> bool:
        return self.block is not None


@dataclasses.dataclass
class Window:
    step: int | None
    inst: str
    req: str
    method: str
    group: int
    start: int
    end: int
    block_size: int
    owned: list[int]  # block ids of the allocation (group ``group``)
    event_id: int
    alloc_id: int | None
    lookahead: int | None  # num_lookahead_tokens the allocation asked for
    blocks: list[WindowBlock]  # the block indices the window touches, plus the last owned one
    finding: bool = False  # a detector finding names this window

    @property
    def capacity(self) -> int:
        return len(self.owned) * self.block_size

    @property
    def outside(self) -> list[int]:
        if self.alloc_id is None:  # no allocation recorded (a model runner's warm-up request): not judged
            return []
        return [p for p in range(self.start, self.end) if p >= self.capacity]


def _block_size(index: TraceIndex, inst: str, g: int) -> int:
    cfg = index.first("sched.config", inst) or {}
    sizes = cfg.get("block_sizes") or [16]
    return int(sizes[g] if g < len(sizes) else sizes[-1])


def _allocs(index: TraceIndex, req: str, inst: str) -> list[tuple[int, dict[str, Any]]]:
    """(ordinal, event) of the request's successful sched.alloc on ``inst``, with block lists
    derived where the file left them out (schema v2 grow events)."""
    ords = [i for i in index.request_ordinals(req, ["sched.alloc"])]
    evs = [(i, e) for i, e in zip(ords, index.events(ords)) if e.get("inst") == inst]
    if evs and any("block_ids" not in e for _, e in evs):
        derive_block_lists([e for _, e in evs])
    return [(i, e) for i, e in evs if e.get("ok", True)]


def _finding_blocks(findings: list[Any]) -> dict[tuple, dict[int, dict[str, Any]]]:
    """(req, step, inst, start, end) -> block index -> the finding's record of that block."""
    out: dict[tuple, dict[int, dict[str, Any]]] = {}
    for f in findings:
        d = f.data or {}
        if f.kind == WINDOW_KIND:
            out[(f.req, f.step, f.inst, d.get("start"), d.get("end"))] = {b["block_index"]: b for b in d.get("blocks") or []}
    return out


def windows(index: TraceIndex, reqs: list[str], findings: list[Any] = ()) -> list[Window]:
    """Every ``spec.window`` of the requests, in trace order, over the allocation it writes into."""
    out: list[Window] = []
    by_window = _finding_blocks(list(findings))
    for req in dict.fromkeys(r for r in reqs if r):
        ords = index.request_ordinals(req, ["spec.window"])
        if not ords:
            continue
        alloc_cache: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for i, w in zip(ords, index.events(ords)):
            inst = w.get("inst", "")
            allocs = alloc_cache.get(inst)
            if allocs is None:
                allocs = alloc_cache[inst] = _allocs(index, req, inst)
            k = bisect.bisect_left(allocs, (i,), key=lambda x: (x[0],))  # the last allocation before it
            a = allocs[k - 1][1] if k else None
            g = w.get("group") or 0
            bs = _block_size(index, inst, g)
            owned = list((a or {}).get("block_ids", [[]])[g]) if a and g < len(a.get("block_ids") or []) else []
            fb = by_window.get((req, w.get("step"), inst, w["start"], w["end"]))
            touched = set(range(w["start"] // bs, (max(w["end"], w["start"] + 1) - 1) // bs + 1))
            if owned:
                touched.add(len(owned) - 1)
            blocks = []
            for bi in sorted(touched):
                lo, hi = bi * bs, (bi + 1) * bs - 1
                wb = WindowBlock(bi, owned[bi] if bi < len(owned) else None, lo, hi,
                                 [p for p in range(w["start"], w["end"]) if lo <= p <= hi])
                info = (fb or {}).get(bi)
                if info:
                    wb.stale_block, wb.stale_from = info.get("stale_block"), info.get("stale_from_req")
                    wb.held_by, wb.shared = list(info.get("held_by") or []), bool(info.get("shared"))
                blocks.append(wb)
            step = w.get("step") if w.get("step") is not None else index.steps[i]  # worker events may lack it
            out.append(Window(step if step is None or step >= 0 else None, inst, req, w.get("method", "?"), g, w["start"], w["end"], bs, owned,
                              w["id"], (a or {}).get("id"), (a or {}).get("num_lookahead_tokens"), blocks,
                              fb is not None))
    return out


def pick(ws: list[Window], step: int | None, limit: int = MAX_WINDOWS) -> tuple[list[Window], int]:
    """The windows worth drawing for a selection -- those outside their allocation, then the
    one(s) at the selected step -- at most ``limit``; and how many others were left out."""
    keep = [w for w in ws if w.outside or w.finding or w.step == step]
    if not keep:
        keep = ws[-3:]
    shown = keep[:limit]
    return shown, len(ws) - len(shown)
