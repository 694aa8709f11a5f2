"""The trace footer: event counts, drops, hook errors, hooks applied / skipped, processes.

``FooterCounter`` counts events one at a time (a streaming merge writes the footer after
events it never held); ``make_footer(events)`` is the same over an iterable.
"""

from __future__ import annotations

from typing import Any, Iterable

from .. import schema


class FooterCounter:
    __slots__ = ("n", "counts", "dropped", "hook_errors", "applied", "skipped", "procs", "ring_discarded")

    def __init__(self) -> None:
        self.n = 0
        self.counts: dict[str, int] = {}
        self.dropped = 0
        self.hook_errors: dict[str, int] = {}
        self.applied: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.procs: dict[int, dict] = {}
        self.ring_discarded: int | None = None  # record --ring: summed from proc.exit

    def add(self, e: dict[str, Any]) -> None:
        self.n += 1
        k = e["ev"]
        self.counts[k] = self.counts.get(k, 0) + 1
        p = self.procs.get(e["pid"])
        if p is None:
            p = self.procs[e["pid"]] = {"pid": e["pid"], "role": e["role"], "inst": e["inst"],
                                        "events": 0, "dropped": 0, "complete": False}
        p["events"] += 1
        p["role"], p["inst"] = e["role"], e["inst"]
        if k == "proc.exit":
            p["complete"] = True
            p["dropped"] = e.get("dropped", 0)
            self.dropped += e.get("dropped", 0)
            if e.get("ring_discarded") is not None:
                self.ring_discarded = (self.ring_discarded or 0) + e["ring_discarded"]
            for h, c in (e.get("hook_errors") or {}).items():
                self.hook_errors[h] = self.hook_errors.get(h, 0) + c
        elif k == "hooks.status":
            self.applied.update(e.get("applied") or ())
            for h, why in (e.get("skipped") or {}).items():
                self.skipped.setdefault(h, why)

    def instances(self) -> list[str]:
        return sorted({p["inst"] for p in self.procs.values()} - {schema.INST_NONE})

    def footer(self, *, exit_code: int | None = None) -> dict[str, Any]:
        skipped = {h: why for h, why in self.skipped.items() if h not in self.applied}
        footer: dict[str, Any] = {
            "ev": schema.FOOTER,
            "events": self.n,
            "counts": dict(self.counts),
            "dropped": self.dropped,
            "hook_errors": dict(self.hook_errors),
            "hooks": {"applied": sorted(self.applied), "skipped": skipped},
            "processes": sorted((dict(p) for p in self.procs.values()), key=lambda p: p["pid"]),
        }
        if exit_code is not None:
            footer["exit_code"] = exit_code
        if self.ring_discarded is not None:
            footer["ring_discarded"] = self.ring_discarded
        return footer


def make_footer(events: Iterable[dict[str, Any]], *, exit_code: int | None = None,
                extra_processes: dict[int, dict] | None = None) -> dict[str, Any]:
    """Summarize events (counts, drops, hook errors, hooks, processes) into a footer."""
    c = FooterCounter()
    for e in events:
        c.add(e)
    return c.footer(exit_code=exit_code)
