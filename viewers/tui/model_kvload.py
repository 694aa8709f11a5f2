"""KV that failed to load, for the Block map pane (issue 36): per D request, each failed load
the scheduler handled (``kvload.request`` with its step's ``kvload.handled``) as the note
``pdtrace check`` prints (``detectors.kv_load.describe`` words it), and the failed block ids.
No Textual imports; events parsed on demand through the index."""

from __future__ import annotations

from typing import Any

from pdtrace.detectors.kv_load import note, same_step
from pdtrace.index.trace_index import TraceIndex


def notes(index: TraceIndex, req: str | None) -> list[dict[str, Any]]:
    """One note per step a failed load of ``req`` was handled at (vLLM 0.30+ handles a failed
    receive twice in a step: the request, then its blocks; one load), in trace order."""
    if not req:
        return []
    out: dict[tuple, dict[str, Any]] = {}
    for e in index.events(index.request_ordinals(req, ["kvload.request"])):
        key = (e.get("inst"), e.get("step"))
        handled = [h for h in index.events(index.step_ordinals(e.get("step"), e.get("inst"), ["kvload.handled"]))
                   if h.get("source") == e.get("source")] if e.get("step") is not None else []
        h = handled[-1] if handled else {}
        n = out.get(key)
        if n is not None:
            same_step(n, e, h)
            n["events"].append(e["id"])
            continue
        out[key] = note(e, h)
    got = list(out.values())
    for n in got:  # scheduled again: its first allocation after the failure (allocate_slots runs when it is)
        again = [a for a in index.events(index.request_ordinals(req, ["sched.alloc"]))
                 if a.get("inst") == n["inst"] and (a.get("step") or -1) > (n["step"] or -1)]
        if again:
            n["ran_again"] = again[0].get("step")
    if got:
        fin = [f for f in index.events(index.request_ordinals(req, ["req.finish"])) if f.get("inst") == got[0]["inst"]]
        if fin:
            got[-1]["finished"] = {"step": fin[-1].get("step"), "status": fin[-1].get("status"),
                                   "output_tokens": fin[-1].get("num_output_tokens")}
        else:
            got[-1]["finished"] = None
    return got


def failed_blocks(loads: list[dict[str, Any]]) -> dict[int, Any]:
    """Block id -> the step its load failure was handled at (the first)."""
    out: dict[int, Any] = {}
    for n in loads:
        for b in n.get("failed_blocks") or ():
            out.setdefault(b, n.get("step"))
    return out
