"""A failed block that one request recomputes and another keeps as computed (issue 50, item 1).

vLLM's ``_update_requests_with_invalid_blocks`` (sync loads, policy ``recompute``): when a failed
block is shared by several running requests, the first one it meets is cut back to that block
and recomputes it; the others keep it as computed, on the assumption (its own comment) that the
first request recomputes it before anyone reads it. Under chunked prefill the first request
rewrites its blocks a chunk per step, while the others are scheduled (decode steps) with the
block in their context: they attend to KV from the failed load until it is rewritten.

Followed per failed block (scheduler, block id): the request that recomputes it, where that
block ends in its token list, its computed tokens step by step (what the handler left plus
what each step scheduled for it); each request that kept the block as computed and is
scheduled at a step whose end still leaves the block unwritten is an error (a block that the
recomputing request rewrites in the same step is written before that step's attention reads it,
layer by layer). The oracle in tests is vLLM's own objects (pdtrace.testing.kv_shared_sim).
"""

from __future__ import annotations

from typing import Any

from .base import KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, Finding

Event = dict[str, Any]


class Watch:
    """One failed block kept by some requests until ``recomputer`` has rewritten it."""

    __slots__ = ("block", "recomputer", "end", "computed", "holders", "handled", "flagged")

    def __init__(self, block: int, recomputer: str, end: int, computed: int, handled: Event) -> None:
        self.block, self.recomputer, self.end, self.computed = block, recomputer, end, computed
        self.holders: dict[str, tuple[int, Event]] = {}  # request -> (its index of the block, its kvload.request)
        self.handled = handled
        self.flagged: set[str] = set()


def watch(watches: dict[tuple, Watch], where: tuple, e: Event, handled: Event, earlier: list[Event],
          B: int, blocks: list[int], bad: set[int], had: int) -> bool:
    """Register ``e``'s failed blocks inside its computed context that an earlier request of the
    call recomputes (True when every one has such a request: vLLM's shared-block rule)."""
    n_blocks = -(-had // B)
    mine = [(i, b) for i, b in enumerate(blocks[:n_blocks]) if b in bad]
    found = []
    for i, b in mine:
        for o in earlier:
            ob = (o.get("block_ids") or [[]])[0]
            if b in ob and o.get("computed", 0) <= ob.index(b) * B:
                found.append((i, b, o, ob.index(b)))
                break
        else:
            return False
    for i, b, o, j in found:
        w = watches.get((*where, b))
        if w is None:
            w = watches[(*where, b)] = Watch(b, str(o.get("req")), (j + 1) * B, int(o.get("computed", 0)), handled)
        w.holders[str(e.get("req"))] = (i, e)
    return True


def scheduled(watches: dict[tuple, Watch], where: tuple, step: Event, findings: list[Finding], B: int) -> None:
    """One step of a scheduler with watched blocks: the recomputing requests' tokens first, then
    each holder scheduled while its block is still unwritten."""
    tokens = step.get("tokens") or {}
    spec = step.get("spec") or {}
    mine = [(k, w) for k, w in watches.items() if k[:3] == where]
    for k, w in mine:
        n = int(tokens.get(w.recomputer, 0) or 0) - int(spec.get(w.recomputer, 0) or 0)
        w.computed += max(0, n)
    stale: dict[str, list[tuple[Watch, int, Event]]] = {}  # holder scheduled now -> its unwritten blocks
    for k, w in mine:
        if w.computed >= w.end:
            del watches[k]
            continue
        for req, (i, e) in w.holders.items():
            if req in tokens and req not in w.flagged:
                stale.setdefault(req, []).append((w, i, e))
    for req, ws in stale.items():  # one finding per request: the first step it read KV nobody wrote
        for w, _i, _e in ws:
            w.flagged.add(req)
        for w in (w for k, w in mine if k in watches):
            w.flagged.add(req)
        findings.append(_finding(ws, req, step, B))


def _finding(ws: list[tuple[Watch, int, Event]], req: str, step: Event, B: int) -> Finding:
    w, i, e = ws[0]
    h = w.handled
    blocks = [x.block for x, _i, _e in ws]
    where = ", ".join(f"block {x.block} (its index {j}, tokens {j * B}-{(j + 1) * B - 1}; {x.recomputer} rewrites it "
                      f"at {x.end} computed tokens)" for x, j, _e in ws[:4])
    return Finding(
        KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, req, step.get("step"), step.get("inst"),
        sorted({x["id"] for _w, _j, ev in ws for x in (h, ev, step) if "id" in x}),
        f"{req} attended failed block(s) {blocks} at step {step.get('step')} before {w.recomputer} recomputed "
        f"them: KV from the failed load",
        f"The connector reported block(s) {sorted(h.get('block_ids') or blocks)[:8]} failed to load (step "
        f"{h.get('step')}), blocks {req} shares with {w.recomputer}; vLLM's _update_requests_with_invalid_blocks cut "
        f"{w.recomputer} back to recompute them and let {req} keep them as computed, on the assumption (its own "
        f"comment) that {w.recomputer} rewrites them before anyone reads them. At step {step.get('step')} {req} was "
        f"scheduled with {blocks} still unwritten in its context ({w.recomputer} had computed {w.computed} "
        f"token(s)): {where}. Under chunked "
        f"prefill it rewrites a chunk per step, so {req} attended to KV that never arrived. Silent wrong output.",
        {"blocks": blocks, "block": w.block, "recomputer": w.recomputer, "recomputed_at": [x.end for x, _i, _e in ws],
         "recomputer_computed": w.computed, "holder_index": i, "block_size": B, "report_step": h.get("step"),
         "shared": True})
