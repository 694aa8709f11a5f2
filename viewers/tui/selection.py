"""Selection helpers over a ``TraceIndex``: the paired request list and the steps a request
has events at (``n`` / ``N``). No Textual imports."""

from __future__ import annotations

from pdtrace.detectors.base import KV_NEVER_CROSSED
from pdtrace.index.trace_index import TraceIndex


def request_rows(index: TraceIndex, bad: set[str], flt: str = "",
                 matched: dict[str, str] | None = None) -> list[tuple[str, str, bool, int]]:
    """(request, instances, has finding, depth) rows: each P request followed by its D
    partner(s) at depth 1 (nixl.remote_alloc / nixl.read name the P request a D request
    reads from; ``matched``, D request -> P request, pairs the detectors made without them: a D request
    that arrived without transfer params, matched to P's by its prompt); pairs with a finding first.
    ``flt`` keeps a pair when either side matches."""
    names = list(index.req_names)
    known = set(names)
    partners: dict[str, list[str]] = {}
    for d, p in [*index.remote_req.items(), *((matched or {}).items())]:
        if p in known and d in known and d != p and d not in partners.get(p, ()):
            partners.setdefault(p, []).append(d)
    under = {d for ds in partners.values() for d in ds}
    by_prompt = {d for d in (matched or {}) if d not in index.remote_req}  # (nothing in the trace names their P)
    flt = flt.lower()
    groups = []
    for r in names:
        if r in under:
            continue
        members = [r] + partners.get(r, [])
        if flt and not any(flt in m.lower() for m in members):
            continue
        rows = [(m, " ".join(index.request_insts(m)) + ("  no params: matched by prompt" if k and m in by_prompt else ""),
                 m in bad, 1 if k else 0) for k, m in enumerate(members)]
        groups.append(rows)
    groups.sort(key=lambda g: not any(row[2] for row in g))  # stable: pairs with findings first
    return [row for g in groups for row in g]


def matched_pairs(findings: list) -> dict[str, str]:
    """D request -> P request, as kv-never-crossed paired them (by P's id in the params, or by the prompt when
    the params were dropped: the pair nothing else in the trace names)."""
    return {str(f.data["d_req"]): str(f.data["p_req"]) for f in findings
            if f.kind == KV_NEVER_CROSSED and (f.data or {}).get("p_req") and f.data.get("d_req")}


def request_steps(index: TraceIndex, req: str | None) -> list[int]:
    """The engine steps at which ``req`` has events, ascending."""
    if not req:
        return []
    steps = index.steps
    return sorted({steps[i] for i in index.request_ordinals(req) if steps[i] >= 0})
