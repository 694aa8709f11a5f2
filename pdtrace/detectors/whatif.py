"""``pdtrace check --what-if fixed-trim``: replay recorded P/D block lists through the fixed rule.

The corrected rule (vLLM PR "Don't transfer spec-decode lookahead blocks"): P clips its
reported ``block_ids`` per attention group to the ``ceil(remote_num_tokens / B)`` blocks
covering the computed tokens, with that group's block size B; state groups (Mamba / SSM)
are passed through untouched. D then end-trims exactly as ``_apply_prefix_caching`` does
(``remote[-n_local:]``). For each request the replay shows, per group, the mapping the
trace recorded next to the mapping the fixed rule produces. Pure Python over events, fed in
trace order (``FixedTrim``): `check --what-if` streams the trace as `check` does.
"""

from __future__ import annotations

from typing import Any

from .index import build
from .lookahead import blocks_needed, end_trim
from .transfers import Joiner, _make, _pos

RULES = ("fixed-trim",)


def fixed_trim(events: list[dict[str, Any]], request: str | None = None) -> list[dict[str, Any]]:
    """Per affected request: ``{req, d_req, groups: [{group, recorded, fixed, changed, ...}]}``.

    A request is listed when P reported blocks the fixed rule clips, or when the recorded
    mapping differs from the fixed one. Pairs are ``[local block, remote block]``.
    """
    st = FixedTrim(request)
    st.feed(build(events))
    return st.finish()


class FixedTrim:
    """``fixed_trim`` over events fed in trace order (``feed`` one ``Index`` at a time, then
    ``finish``), as the streamed check feeds its detectors: each transfer is replayed when
    ``transfers.Joiner`` completes it, and only the affected ones are kept."""

    def __init__(self, request: str | None = None):
        self.request = request
        self.joiner = Joiner(self._replay)
        self.out: list[tuple[tuple, dict[str, Any]]] = []

    def feed(self, idx: Any) -> None:
        self.joiner.feed(idx)

    __call__ = feed  # stream.run(observe=...) hands it each segment's Index

    def _replay(self, p: Any, a: Any, ctx: tuple) -> None:
        tr = _make(self.joiner.configs, p, a, *ctx)
        if self.request is not None and self.request not in (tr.p_req, tr.d_req):
            return
        r = replay(tr)
        if r is not None:  # join_transfers' order: P reports in trace order, then D-only allocations
            self.out.append(((0, _pos(p)) if p is not None else (1, _pos(a)), r))

    def finish(self) -> list[dict[str, Any]]:
        self.joiner.finish()
        self.out.sort(key=lambda x: x[0])
        return [r for _k, r in self.out]


def replay(tr: Any) -> dict[str, Any] | None:
    """One transfer through the fixed rule: its entry, or None when nothing changes."""
    groups = []
    affected = False
    for g, R in enumerate(tr.reported):
        B = tr.block_size(g)
        attention = tr.is_attention(g)
        rnt = tr.remote_num_tokens
        clipped = R[:blocks_needed(rnt, B)] if attention and rnt is not None else list(R)
        local = tr.local[g] if tr.local is not None and g < len(tr.local) else None
        recorded = [list(p) for p in tr.mapping[g]] if tr.mapping is not None and g < len(tr.mapping) else None
        if local is None:
            fixed = None
            note = "no D side in the trace: showing P's clipped report only"
        elif attention:
            if len(local) > len(clipped):
                note = (f"D allocated {len(local)} blocks but the fixed report has {len(clipped)}: "
                        f"vLLM would reject this transfer")
                fixed = [list(p) for p in zip(local, clipped)]
            else:
                note = ""
                fixed = [list(p) for p in end_trim(local, clipped)]
        else:
            note = "state group: passed through unchanged"
            fixed = [list(p) for p in zip(local, clipped)]
        changed = (clipped != list(R)) or (recorded is not None and fixed is not None and recorded != fixed)
        affected |= changed
        groups.append({
            "group": g, "group_kind": tr.group_kind(g), "state_group": not attention, "block_size": B,
            "reported": list(R), "clipped": clipped, "local": local,
            "recorded": recorded, "fixed": fixed, "changed": changed, "note": note,
        })
    if not affected:
        return None
    return {"req": tr.req, "p_req": tr.p_req, "d_req": tr.d_req,
            "remote_num_tokens": tr.remote_num_tokens, "mapping_source": tr.mapping_source,
            "event_ids": tr.event_ids(), "groups": groups}


def run(rule: str, events: list[dict[str, Any]], request: str | None = None) -> list[dict[str, Any]]:
    if rule == "fixed-trim":
        return fixed_trim(events, request)
    raise ValueError(f"unknown --what-if rule {rule!r}; valid: {', '.join(RULES)}")


def _pairs(ps: list | None) -> str:
    if ps is None:
        return "-"
    return " ".join(f"{a}<-{b}" for a, b in ps) or "(none)"


def render_text(results: list[dict[str, Any]]) -> str:
    if not results:
        return "what-if fixed-trim: no request's mapping changes under the fixed rule.\n"
    lines = [f"what-if fixed-trim: {len(results)} request(s) change under the fixed rule "
             "(pairs are local<-remote)"]
    for r in results:
        lines.append(f"  request {r['req']}" + (f" (D: {r['d_req']})" if r["d_req"] and r["d_req"] != r["req"] else "")
                     + f", remote_num_tokens={r['remote_num_tokens']}, recorded from {r['mapping_source']}")
        for g in r["groups"]:
            tag = "state group, untouched" if g["state_group"] else f"block size {g['block_size']}"
            lines.append(f"    group {g['group']} ({g['group_kind'] or 'attention'}, {tag}): "
                         f"P reported {g['reported']} -> fixed report {g['clipped']}")
            lines.append(f"      recorded: {_pairs(g['recorded'])}")
            lines.append(f"      fixed:    {_pairs(g['fixed'])}" + ("   (changed)" if g["changed"] else ""))
            if g["note"]:
                lines.append(f"      note: {g['note']}")
    return "\n".join(lines) + "\n"


def render_markdown(results: list[dict[str, Any]]) -> str:
    if not results:
        return "### What if: fixed-trim\n\nNo request's mapping changes under the fixed rule.\n"
    lines = ["### What if: fixed-trim", "",
             "Recorded P/D block lists replayed through the fixed rule (P clips to the blocks covering "
             "`remote_num_tokens` per attention group; D end-trims). Pairs are `local<-remote`.", "",
             "| request | group | P reported | fixed report | recorded mapping | fixed mapping |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for g in r["groups"]:
            lines.append(f"| `{r['req']}` | {g['group']}{' (state)' if g['state_group'] else ''} | "
                         f"`{g['reported']}` | `{g['clipped']}` | `{_pairs(g['recorded'])}` | `{_pairs(g['fixed'])}` |")
    return "\n".join(lines) + "\n"
