"""Detectors: pure functions over loaded events (no vLLM / torch import, no file I/O).

``DETECTORS`` maps each finding kind (``pdtrace.detectors.base``) to a function
``(events, header) -> list[Finding]``; ``run_all`` runs them and sorts the findings by
(step, kind). Detectors share one per-trace index (``pdtrace.detectors.index.build``).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterable

from pdtrace.tracefile.trace import EventList, derive_block_lists

from . import (crossed, drafter_window, kv_invariant, kv_load, lease_verdict, lookahead, metadata, ringcut,
               stale_read)
from .base import (
    ALL_KINDS,
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION,
    KV_INVARIANT,
    KV_LOAD_FAILURE_RECOVERY,
    KV_NEVER_CROSSED,
    LOOKAHEAD_MISALIGNMENT,
    METADATA_CLEARED_BEFORE_DRAFTER,
    SEVERITY_ERROR,
    SEVERITY_WARNING,
    STALE_ACCEPTED_COUNT_READ,
    Finding,
)
from .index import build, feed_all

DetectorFn = Callable[[list[dict[str, Any]], dict], list[Finding]]

DETECTORS: dict[str, DetectorFn] = {
    LOOKAHEAD_MISALIGNMENT: lookahead.detect,
    METADATA_CLEARED_BEFORE_DRAFTER: metadata.detect,
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION: drafter_window.detect,
    STALE_ACCEPTED_COUNT_READ: stale_read.detect,
    KV_LOAD_FAILURE_RECOVERY: kv_load.detect,
    KV_NEVER_CROSSED: crossed.detect,
    KV_INVARIANT: kv_invariant.detect,
}
assert tuple(DETECTORS) == ALL_KINDS


def unknown_kinds(only: Iterable[str]) -> list[str]:
    return [k for k in only if k not in DETECTORS]


def _about(f: Finding, request: str | Iterable[str]) -> bool:
    """Whether finding ``f`` is about ``request`` (an id, or a set of ids: a request and the other
    side of its P/D pair, ``stream.RequestSeen.wanted``)."""
    wanted = {request} if isinstance(request, str) else set(request)
    if f.req in wanted:
        return True
    d = f.data or {}
    return bool(wanted & {d.get("p_req"), d.get("d_req"), *(d.get("reqs") or ())})


def sort_key(f: Finding) -> tuple:
    return (f.step if f.step is not None else -1, f.kind, f.req or "", f.event_ids[:1])


_SEVERITY_ORDER = {"error": 0, "warning": 1}


def by_severity(findings: Iterable[Any]) -> list[Any]:
    """Errors first, then warnings, then inconclusive findings; each in trace order (step, kind).
    The order every human-facing view numbers them in (check's text and markdown, the viewer's
    findings list and `f`, the HTML report), so "finding 3" is the same finding in each (a live
    trace's 14 errors were numbered among 79 warnings); JSON keeps (step, kind). Findings or their
    JSON dicts."""
    return sorted(findings, key=lambda f: _SEVERITY_ORDER.get(f.get("severity") if isinstance(f, dict) else f.severity, 2))


def run_all(events: list[dict[str, Any]], header: dict | None = None, only: Iterable[str] = (),
            request: str | Iterable[str] | None = None) -> list[Finding]:
    """Run the selected detectors (all when ``only`` is empty); findings sorted by (step, kind)."""
    return run_with_notes(events, header, only, request)[0]


def run_with_notes(events: list[dict[str, Any]], header: dict | None = None, only: Iterable[str] = (),
                   request: str | Iterable[str] | None = None) -> tuple[list[Finding], dict[str, list]]:
    """``run_all``'s findings, and the facts of the detectors that ran as streams here (the KV invariant's:
    ``checking`` gathers the other detectors' facts without running the invariant twice)."""
    only = list(only or ())
    bad = unknown_kinds(only)
    if bad:
        raise ValueError(f"unknown detector kind(s) {bad}; valid: {', '.join(DETECTORS)}")
    header = header or {}
    findings: list[Finding] = []
    # The loaded events are millions of dicts without cycles; a cyclic-GC pass triggered by
    # the detectors' own allocations would walk all of them. Pause it while detectors run.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        # schema v2 sched.alloc without block_ids: a no-op for a list trace.load already
        # derived; other lists are walked through their sched.alloc group only
        derive_block_lists(events if isinstance(events, EventList) else build(events).kind("sched.alloc"))
        notes: dict[str, list] = {}
        for kind, fn in DETECTORS.items():
            if only and kind not in only:
                continue
            if kind == KV_INVARIANT:  # (its notes settle the expired-lease findings: lease_verdict)
                st = kv_invariant.Stream(header)
                findings.extend(feed_all(st, events))
                notes[kind] = st.notes()
                continue
            findings.extend(fn(events, header))
    finally:
        if was_enabled:
            gc.enable()
    findings = lease_verdict.reconcile(findings, notes, header)
    findings = ringcut.mark(findings, events, header)  # flight-recorder traces: cut beginnings
    if request is not None:
        findings = [f for f in findings if _about(f, request)]
    findings.sort(key=sort_key)
    return findings, notes


__all__ = [
    "ALL_KINDS", "DETECTORS", "Finding", "run_all", "run_with_notes", "unknown_kinds", "sort_key", "by_severity",
    "SEVERITY_ERROR", "SEVERITY_WARNING",
    "LOOKAHEAD_MISALIGNMENT", "METADATA_CLEARED_BEFORE_DRAFTER",
    "DRAFTER_WINDOW_OUTSIDE_ALLOCATION", "STALE_ACCEPTED_COUNT_READ", "KV_LOAD_FAILURE_RECOVERY",
    "KV_NEVER_CROSSED", "KV_INVARIANT",
]
