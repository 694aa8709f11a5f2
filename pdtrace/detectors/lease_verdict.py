"""P's expired lease (kv-never-crossed's rule) against the KV model and the trace's clocks (issue 59).

The lease rule sees that P's lease on a request ran out and that D read the request's blocks; it does
not see what those blocks held when D read them, nor can it order the two events better than the
trace's clocks do. This module settles both after the detectors ran, so every command says the same:

- **What D read** comes from the KV model (``kv_invariant``): a kv-invariant finding on a D request
  that loaded from that P request means D read KV that was not its own (the ERROR stands, the
  invariant confirms it); the model's ``lease_intact`` note means D read every loaded block and each
  held D's own positions: P had not reused them yet, the KV is intact (a WARNING: the race was won
  this time); its ``lease_unread`` note means D freed the request before any step attended to the loaded
  blocks: nothing was decoded on them (a WARNING); none of these means the model did not judge it (the rule's
  ERROR stands, and says so).
- **The order** comes from the clocks: one host's trace orders them (every process reads one wall
  clock); a merged trace orders them only when the gap is wider than the merge's residual skew.
  The title says what the data says: "ran out before D's read" only for a read issued after the
  expiry; a read issued before it is "ran out while D's read was in flight"; too close to order,
  "ran out around D's read".

Nothing here reads events: it reads the findings, the invariant's notes and the header.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import KV_INVARIANT, KV_NEVER_CROSSED, SEVERITY_ERROR, SEVERITY_WARNING, Finding
from .request_ids import base_id


def skew_s(header: dict) -> float | None:
    """How far apart two of the trace's processes' clocks can be, in seconds: 0 for one host's trace, the
    largest residual of a merge's clock fit, None when a merged trace does not say."""
    if header.get("origin") != "merge":
        return 0.0
    fits = ((header.get("clock") or {}).get("traces")) or []
    res = [f.get("residual_ns") for f in fits]
    if not res or any(not isinstance(x, (int, float)) for x in res):
        return None
    return max(res) / 1e9


def _order(gap: Any, skew: float | None) -> str:
    """'after' (D's read issued after the expiry), 'before', or 'unknown', by the clocks."""
    if not isinstance(gap, (int, float)) or skew is None:
        return "unknown"
    if gap > skew:
        return "after"
    if gap < -skew:
        return "before"
    return "unknown"


def reconcile(findings: list[Finding], notes: dict[str, list], header: dict) -> list[Finding]:
    """``findings`` with each expired-lease finding's title, severity and data settled by the KV model
    (``notes[kv-invariant]``: absent when that class did not run) and the clocks."""
    leases = [f for f in findings if f.kind == KV_NEVER_CROSSED and (f.data or {}).get("mechanism") == "expired-lease"
              and "kv" not in f.data]  # (not one settled already)
    if not leases:
        return findings
    note = (notes.get(KV_INVARIANT) or [{}])[0]
    intact = {base_id(p) for p in note.get("lease_intact") or ()}
    unread = {base_id(p) for p in note.get("lease_unread") or ()}
    bad = {base_id((f.data or {}).get("p_req")) for f in findings
           if f.kind == KV_INVARIANT and (f.data or {}).get("p_req")}  # (by base id: D may name P by the router's)
    skew = skew_s(header)
    settle = {id(f) for f in leases}
    out = []
    for f in findings:
        if id(f) not in settle:
            out.append(f)
            continue
        d = dict(f.data)
        p_req, gap = str(d.get("p_req")), d.get("read_after_s")
        order = _order(gap, skew)
        d["order"] = order
        d["clock_skew_s"] = skew
        if not note:
            verdict = "not judged (the kv-invariant class did not run)"
        elif base_id(p_req) in bad:
            verdict = "reused"
        elif base_id(p_req) in intact:
            verdict = "intact"
        elif base_id(p_req) in unread:
            verdict = "unread"
        else:
            verdict = "not judged (D's read of those blocks was not checked by the KV model)"
        d["kv"] = verdict
        n = len(d.get("remote_blocks") or [])
        when = {"after": "ran out before D's read",
                "before": f"ran out while D's read of them was in flight (D issued it {-gap * 1e3:.2f} ms before)"
                if isinstance(gap, (int, float)) else "ran out while D's read was in flight",
                "unknown": "ran out around D's read (the trace's clocks cannot order the two"
                           + (f": {abs(gap) * 1e3:.2f} ms apart, clocks within {skew * 1e3:.2f} ms)"
                              if isinstance(gap, (int, float)) and skew is not None else ")")}[order]
        if verdict == "intact":
            title = (f"P's lease on {p_req} {when}, but P had not reused its {n} block(s) yet: the KV D read is "
                     f"intact (a race D won this time)")
            extra = (" The KV model followed each block D loaded from it: every one still held D's own positions "
                     "when D's steps read them, so this time nothing was read wrong; the next request that "
                     "reaches D as late may not be so lucky.")
            sev = SEVERITY_WARNING
        elif verdict == "unread":
            title = (f"P's lease on {p_req} {when}; D freed the request before any step attended to the {n} block(s) "
                     f"it loaded: nothing was decoded on them")
            extra = (" The KV model followed the blocks D loaded from it: the request ended on D (aborted, or its "
                     "client gone) before a step read them, so whatever they held was never used.")
            sev = SEVERITY_WARNING
        elif verdict == "reused":
            title = f"D read KV P had already released: P's lease on {p_req} {when}, and P had reused the block(s)"
            extra = " The KV invariant confirms it: D's step read KV that was not its own (its finding's chain)."
            sev = SEVERITY_ERROR
        else:
            title = f"P's lease on {p_req} {when}: D may have loaded {n} block(s) P had freed for other requests"
            extra = f" What the blocks held when D read them: {verdict}."
            sev = f.severity
        out.append(dataclasses.replace(f, title=title, explanation=f.explanation + extra, severity=sev, data=d))
    return out
