"""Findings on what a flight-recorder window cut in two (``pdtrace record --ring``).

A ring trace keeps about the last N seconds of each process's events: a request that began
before the window has lost its beginning, a worker step its ``kvmeta.bind``, an
accepted-count read the D2H copy it read from. A finding that rests on such a cut is not a
claim of a bug: ``mark`` turns it ``inconclusive`` and says which beginning is missing, so
``check`` exits 4 for it, not 1. Applied only to traces whose header has ``ring_s``.

What counts as cut, per finding:

- a request it names (``req``, ``data.p_req`` / ``data.d_req``) has events in the trace but
  no ``req.add`` on an instance whose scheduler hooks recorded its steps (``sched.step``)
  and its allocations (scheduler-side classes: lookahead, drafter window);
- a stale accepted-count read whose D2H copy (``data.d2h_event``) has no ``d2h.issue`` in
  the trace;
- a connector-metadata finding whose step has no ``kvmeta.bind`` among its cited events.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import (
    METADATA_CLEARED_BEFORE_DRAFTER,
    SEVERITY_INCONCLUSIVE,
    STALE_ACCEPTED_COUNT_READ,
    Finding,
)
from .index import build


class _Facts:
    """What the trace holds of the beginnings, gathered once per trace."""

    def __init__(self, idx: Any, events: list[dict[str, Any]], need_ids: bool):
        self.issued = {e.get("event") for e in idx.kind("d2h.issue")}
        self.added: dict[Any, set] = {}
        for e in idx.kind("req.add"):
            self.added.setdefault(e.get("inst"), set()).add(e.get("req"))
        self.stepped = {e.get("inst") for e in idx.kind("sched.step")}  # the scheduler hooks recorded there
        self.alloc_insts: dict[Any, set] = {}
        for e in idx.kind("sched.alloc"):
            self.alloc_insts.setdefault(e.get("req"), set()).add(e.get("inst"))
        self.kind_of = {e["id"]: e["ev"] for e in events if "id" in e} if need_ids else {}


def _why(f: Finding, facts: _Facts) -> str | None:
    if f.kind == STALE_ACCEPTED_COUNT_READ:
        ev = (f.data or {}).get("d2h_event")
        if ev is not None and ev not in facts.issued:
            return f"the D2H copy it read from ({ev!r}) was issued before the window began"
        return None
    if f.kind == METADATA_CLEARED_BEFORE_DRAFTER:
        if not any(facts.kind_of.get(i) == "kvmeta.bind" for i in f.event_ids):
            return f"the step's kvmeta.bind (step {f.step}) is before the window began"
        return None
    d = f.data or {}
    for r in sorted({x for x in (f.req, d.get("p_req"), d.get("d_req")) if x}):
        for inst in sorted(facts.alloc_insts.get(r, ()), key=str):
            if inst in facts.stepped and r not in facts.added.get(inst, ()):
                return f"request {r} began on {inst} before the window (its req.add was discarded)"
    return None


def mark(findings: list[Finding], events: list[dict[str, Any]], header: dict | None) -> list[Finding]:
    """``findings`` with those resting on a cut made inconclusive (ring traces only)."""
    if not (header or {}).get("ring_s") or not findings:
        return findings
    facts = _Facts(build(events), events, any(f.kind == METADATA_CLEARED_BEFORE_DRAFTER for f in findings))
    out = []
    for f in findings:
        why = _why(f, facts) if f.severity != SEVERITY_INCONCLUSIVE else None
        if why is None:
            out.append(f)
            continue
        out.append(_inconclusive(f, {"ring_cut": why, "severity_in_window": f.severity},
                                 "(cut by the flight-recorder window)",
                                 f"This is a flight-recorder trace (record --ring {header['ring_s']:g} s) and {why}: "
                                 f"what the finding rests on may be missing, so it is not a verdict."))
    return out


def _inconclusive(f: Finding, extra: dict[str, Any], prefix: str, because: str) -> Finding:
    """``f`` made inconclusive: ``extra`` added to its data, ``prefix`` before its title, ``because``
    after its explanation (a flight-recorder cut, a damaged file's gap)."""
    return dataclasses.replace(f, severity=SEVERITY_INCONCLUSIVE, title=f"{prefix} {f.title}",
                               explanation=f"{f.explanation} {because}", data={**(f.data or {}), **extra})


def mark_after_gap(findings: list[Finding], after: Any, where: str) -> list[Finding]:
    """``findings`` with those citing an event read after a gap of a damaged file (``after(event
    id)``: whether that event comes after the first gap; ``where``: the gap, in words) made
    inconclusive. The lines the gap took held row moves, allocations, copies the detectors'
    state needed (a live-shaped trace read on past one damaged zstd frame gave 30 warnings of
    reads "through another row" whose batch.add was in the gap): a finding after it is not a
    verdict. Findings before the gap stand."""
    out = []
    for f in findings:
        if f.severity == SEVERITY_INCONCLUSIVE or not any(after(i) for i in f.event_ids or ()):
            out.append(f)
            continue
        out.append(_inconclusive(f, {"after_gap": where, "severity_before_gap": f.severity}, "(after a damaged stretch)",
                                 f"It cites events read after {where}: what the lost lines held (row moves, "
                                 f"allocations, copies) may be what makes it, so it is not a verdict."))
    return out
