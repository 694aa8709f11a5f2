"""lookahead-block-misalignment (vLLM threads 000/001).

P's ``request_finished`` reports ``remote_num_tokens`` = computed tokens but (before the
fix) its whole allocation as ``remote_block_ids``, including trailing lookahead blocks
reserved for spec decode. When the prompt ends on a block boundary the lookahead slot
spills into an extra block; D's ``_apply_prefix_caching`` end-trims ``remote[-n_local:]``
(assuming the surplus is a cached prefix at the front), drops P's real first block and
pairs every D block with the P block one further on.

This module joins P's ``nixl.request_finished`` with D's ``nixl.remote_alloc`` /
``nixl.trim`` / ``nixl.read`` for the same request, and, per attention group with block
size B, checks each recorded pair (local block i <- remote block r) against P's block
covering the same token range. ``join_transfers`` is shared with ``pdtrace.whatif``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import LOOKAHEAD_MISALIGNMENT, SEVERITY_ERROR, SEVERITY_WARNING, Finding
from .index import Index, build, is_attention_group

Event = dict[str, Any]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) if block_size > 0 else 0


@dataclasses.dataclass
class Transfer:
    """Everything the trace says about one P->D KV transfer of one request."""

    p_req: str | None
    d_req: str | None
    p_finished: Event | None  # P's nixl.request_finished
    d_alloc: Event | None  # D's nixl.remote_alloc
    trim: Event | None  # D's last nixl.trim for the request
    reads: list[Event]  # D's nixl.read events for the request
    config: Event | None  # sched.config used for block sizes / group kinds
    remote_num_tokens: int
    reported: list[list[int]]  # P's remote_block_ids per group
    local: list[list[int]] | None  # D's local blocks to load, per group (None: no D side)
    mapping: list[list[tuple[int, int]]] | None  # recorded (local, remote) pairs per group
    mapping_source: str  # nixl.read | nixl.trim | inferred | none

    @property
    def req(self) -> str | None:
        return self.p_req or self.d_req

    def block_size(self, g: int) -> int:
        sizes = (self.config or {}).get("block_sizes") or [16]
        return int(sizes[g] if g < len(sizes) else sizes[-1])

    def group_kind(self, g: int) -> str:
        kinds = (self.config or {}).get("group_kinds") or []
        return kinds[g] if g < len(kinds) else ""

    def is_attention(self, g: int) -> bool:
        return is_attention_group(self.group_kind(g))

    def event_ids(self) -> list[int]:
        evs = [self.p_finished, self.config, self.d_alloc, self.trim, *self.reads]
        return sorted({e["id"] for e in evs if e is not None and "id" in e})


def end_trim(local: list[int], remote: list[int]) -> list[tuple[int, int]]:
    """D's ``_apply_prefix_caching`` for one token-indexed group: keep ``remote[-n_local:]``."""
    n = len(local)
    if n == 0:
        return []
    if n < len(remote):
        remote = remote[-n:]
    return list(zip(local, remote))


def _pairs_from_reads(reads: list[Event], ngroups: int) -> list[list[tuple[int, int]]]:
    if len(reads) == 1:  # the usual case: one read, no local block twice in a group
        r = reads[0]
        groups = list(zip(r.get("local_block_ids") or [], r.get("remote_block_ids") or []))
        if all(len(set(ls)) == len(ls) for ls, _rs in groups):
            pairs: list[list[tuple[int, int]]] = [list(zip(ls, rs)) for ls, rs in groups]
            pairs.extend([] for _ in range(ngroups - len(groups)))
            return pairs
    out: list[list[tuple[int, int]]] = [[] for _ in range(ngroups)]
    seen: list[set[int]] = [set() for _ in range(ngroups)]
    for r in reads:
        for g, (ls, rs) in enumerate(zip(r.get("local_block_ids") or [], r.get("remote_block_ids") or [])):
            if g >= ngroups:
                out.append([])
                seen.append(set())
                ngroups += 1
            for lb, rb in zip(ls, rs):
                if lb not in seen[g]:
                    seen[g].add(lb)
                    out[g].append((lb, rb))
    return out


def join_transfers(events: list[Event], idx: Index | None = None) -> list[Transfer]:
    """Pair P's reports with D's allocations / trims / reads, one ``Transfer`` per request."""
    idx = idx or build(events)
    return [_make(idx, p, a, *ctx) for p, a, ctx in _pairs(idx)]


def _pairs(idx: Index) -> list[tuple[Event | None, Event | None, tuple]]:
    """(P's nixl.request_finished, D's nixl.remote_alloc, the trims / reads lookups) per
    request, in ``join_transfers`` order: the arguments of ``_make``."""
    finished = [e for e in idx.kind("nixl.request_finished") if e.get("side", "P") == "P"]
    allocs = idx.kind("nixl.remote_alloc")
    trims = idx.kind("nixl.trim")
    reads = idx.kind("nixl.read")
    if not finished and not allocs:
        return []

    alloc_by_key: dict[str, Event] = {}
    for a in allocs:
        for key in (a.get("remote_req"), a.get("req")):
            if key is not None:
                alloc_by_key.setdefault(key, a)
    trims_by_req: dict[str, Event] = {}
    unkeyed_trims: list[Event] = []
    for t in trims:
        if t.get("req") is not None:
            trims_by_req[t["req"]] = t  # the last trim wins
        else:
            unkeyed_trims.append(t)
    reads_by_req: dict[str, list[Event]] = {}
    for r in reads:
        key = r.get("req") or r.get("remote_req")
        if key is not None:
            reads_by_req.setdefault(key, []).append(r)

    ctx = (trims_by_req, unkeyed_trims, reads_by_req)
    out: list[tuple[Event | None, Event | None, tuple]] = []
    used_allocs: set[int] = set()
    for p in finished:
        a = alloc_by_key.get(p.get("req")) if p.get("req") is not None else None
        if a is not None:
            used_allocs.add(id(a))
        out.append((p, a, ctx))
    for a in allocs:  # D-only traces: P's report as D received it
        if id(a) not in used_allocs:
            out.append((None, a, ctx))
    return out


def _same(groups: Any) -> Any:
    return groups


def _copied(groups: Any) -> list[list[int]]:
    return [list(g) for g in groups]


def _make(idx: Index, p: Event | None, a: Event | None, trims_by_req: dict[str, Event],
          unkeyed_trims: list[Event], reads_by_req: dict[str, list[Event]], copy: bool = True) -> Transfer:
    """The ``Transfer`` of one request. ``copy=False`` (a first look by ``detect``) leaves the
    per-group block lists as the events hold them instead of copying them."""
    lists = _copied if copy else _same
    d_req = a.get("req") if a is not None else None
    p_req = p.get("req") if p is not None else (a.get("remote_req") if a is not None else None)
    if p is not None:
        reported = lists(p["block_ids"])
        rnt = int(p["remote_num_tokens"])
        config = idx.config(p.get("inst"))
    else:
        assert a is not None
        reported = lists(a["remote_block_ids"])
        rnt = a.get("remote_num_tokens")
        if rnt is None:  # no token count on D: fall back to what P reported
            rnt = 0
        config = None
    if config is None and a is not None:
        config = idx.config(a.get("inst"))
    trim = None
    rd: list[Event] = []
    local = None
    mapping = None
    source = "none"
    if a is not None:
        local = lists(a["local_block_ids"])
        key = d_req if d_req is not None else p_req
        trim = trims_by_req.get(key) if key is not None else None
        if trim is None:
            for t in unkeyed_trims:
                if t["local_in"] == a["local_block_ids"] and t["remote_in"] == a["remote_block_ids"]:
                    trim = t
        rd = list(reads_by_req.get(key, ())) if key is not None else []
        if not rd and p_req is not None and p_req != key:
            rd = [r for r in reads_by_req.get(p_req, ()) if r.get("remote_req") == p_req]
        if trim is not None:
            local = lists(trim["local_in"])
        if rd:
            mapping = _pairs_from_reads(rd, len(reported))
            source = "nixl.read"
        elif trim is not None:
            mapping = [list(zip(lo, ro)) for lo, ro in zip(trim["local_out"], trim["remote_out"])]
            source = "nixl.trim"
        else:
            remote_in = lists(a["remote_block_ids"])
            mapping = []
            for g, lo in enumerate(local):
                ro = remote_in[g] if g < len(remote_in) else []
                cfg_kinds = (config or {}).get("group_kinds") or []
                kind = cfg_kinds[g] if g < len(cfg_kinds) else ""
                mapping.append(end_trim(lo, ro) if is_attention_group(kind) else list(zip(lo, ro)))
            source = "inferred"
    return Transfer(p_req, d_req, p, a, trim, rd, config, rnt, reported, local, mapping, source)


def analyze_group(tr: Transfer, g: int) -> dict[str, Any]:
    """Per-group verdict data: needed/extra blocks and each recorded pair checked."""
    B = tr.block_size(g)
    R = tr.reported[g] if g < len(tr.reported) else []
    attention = tr.is_attention(g)
    needed = blocks_needed(tr.remote_num_tokens, B)
    extra = max(0, len(R) - needed) if attention else 0
    info: dict[str, Any] = {
        "group": g, "group_kind": tr.group_kind(g), "state_group": not attention,
        "block_size": B, "remote_num_tokens": tr.remote_num_tokens, "blocks_needed": needed,
        "reported": R, "extra_blocks": R[needed:] if attention else [],
        "pairs": [], "mismatches": 0, "shift": None,
    }
    if not attention or tr.mapping is None or g >= len(tr.mapping):
        return info
    pairs = tr.mapping[g]
    L = tr.local[g] if tr.local is not None and g < len(tr.local) and tr.local[g] else [lb for lb, _ in pairs]
    pos_of = {lb: i for i, lb in enumerate(L)}
    n = len(L)
    first = needed - n if n <= needed else 0
    pos_in_R = {rb: j for j, rb in enumerate(R)}
    shifts = set()
    for k, (lb, rb) in enumerate(pairs):
        i = pos_of.get(lb, k)
        gi = first + i
        expected = R[gi] if 0 <= gi < min(needed, len(R)) else None
        lo_tok = gi * B
        hi_tok = min((gi + 1) * B, tr.remote_num_tokens)
        shift = None
        if expected is not None and rb != expected:
            info["mismatches"] += 1
            j = pos_in_R.get(rb)
            shift = (j - gi) if j is not None else None
            shifts.add(shift)
        info["pairs"].append({
            "local_index": i, "local": lb, "remote": rb, "expected": expected,
            "tokens": [lo_tok, hi_tok] if expected is not None else None,
            "ok": expected is None or rb == expected, "shift": shift,
        })
    if shifts:
        info["shift"] = shifts.pop() if len(shifts) == 1 else sorted(s for s in shifts if s is not None) or None
    return info


def _flagged(tr: Transfer) -> bool:
    """Whether ``analyze_group`` finds mismatches or extra blocks in any group of ``tr``: the
    same arithmetic, without building the per-pair report (most transfers are fine)."""
    rnt = tr.remote_num_tokens
    for g in range(len(tr.reported)):
        B = tr.block_size(g)
        if not tr.is_attention(g):
            continue
        R = tr.reported[g]
        needed = blocks_needed(rnt, B)
        if R[needed:]:
            return True
        if tr.mapping is None or g >= len(tr.mapping):
            continue
        pairs = tr.mapping[g]
        L = tr.local[g] if tr.local is not None and g < len(tr.local) and tr.local[g] else [lb for lb, _ in pairs]
        n = len(L)
        first = needed - n if n <= needed else 0
        top = min(needed, len(R))
        m = len(pairs)
        if m <= n and len(set(L)) == n:
            lbs, rbs = (list(c) for c in zip(*pairs)) if pairs else ([], [])
            if lbs == L[:m]:  # pair k is local block k: one slice comparison decides
                lo, hi = max(0, -first), min(m, top - first)
                if lo >= hi or rbs[lo:hi] == R[first + lo:first + hi]:
                    continue
        pos_of = {lb: i for i, lb in enumerate(L)}
        for k, (lb, rb) in enumerate(pairs):
            gi = first + pos_of.get(lb, k)
            if 0 <= gi < top:
                expected = R[gi]
                if expected is not None and rb != expected:
                    return True
    return False


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    idx = build(events)
    findings: list[Finding] = []
    for p, a, ctx in _pairs(idx):
        if not _flagged(_make(idx, p, a, *ctx, copy=False)):  # most transfers are fine
            continue
        tr = _make(idx, p, a, *ctx)
        groups = [analyze_group(tr, g) for g in range(len(tr.reported))]
        bad = [gi for gi in groups if gi["mismatches"]]
        latent = [gi for gi in groups if gi["extra_blocks"]]
        if not bad and not latent:
            continue
        data = {
            "p_req": tr.p_req, "d_req": tr.d_req, "remote_num_tokens": tr.remote_num_tokens,
            "prompt_len": (tr.p_finished or {}).get("prompt_len"),
            "mapping_source": tr.mapping_source, "groups": groups,
        }
        if bad:
            step_ev = (tr.reads[0] if tr.reads else tr.trim or tr.d_alloc) or {}
            g0 = bad[0]
            wrong = [p for p in g0["pairs"] if not p["ok"]]
            w = wrong[0]
            shift_txt = f"{g0['shift']:+d}" if isinstance(g0["shift"], int) else str(g0["shift"])
            title = (f"request {tr.req}: D block {w['local']} read P block {w['remote']} instead of "
                     f"{w['expected']} (group {g0['group']}, shift {shift_txt})")
            expl = (
                f"P reported {len(g0['reported'])} block(s) {g0['reported']} for group {g0['group']} "
                f"(block size {g0['block_size']}) but remote_num_tokens={tr.remote_num_tokens} needs only "
                f"{g0['blocks_needed']}; trailing lookahead block(s) {g0['extra_blocks']} hold no prompt KV. "
                f"D ({tr.mapping_source}) paired its {len(g0['pairs'])} local block(s) by end-trim, so "
                + "; ".join(
                    f"local #{p['local_index']} (block {p['local']}, tokens {p['tokens'][0]}-{p['tokens'][1] - 1}) "
                    f"<- P block {p['remote']} instead of {p['expected']}"
                    for p in wrong[:4])
                + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
                + f". The mapping is shifted by {shift_txt} block(s): D attends to KV P never wrote for "
                f"these tokens. {len(bad)} group(s) affected."
            )
            findings.append(Finding(
                kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_ERROR, req=tr.req,
                step=step_ev.get("step"), inst=step_ev.get("inst", "D"), event_ids=tr.event_ids(),
                title=title, explanation=expl, data=data))
        else:
            g0 = latent[0]
            p = tr.p_finished or tr.d_alloc or {}
            checked = ("D's recorded mapping is still correct" if tr.mapping is not None
                       else "no D side for this request in the trace")
            title = (f"request {tr.req}: P reported {len(g0['extra_blocks'])} trailing lookahead block(s) "
                     f"{g0['extra_blocks']} beyond remote_num_tokens={tr.remote_num_tokens} (latent)")
            expl = (
                f"P reported {len(g0['reported'])} block(s) {g0['reported']} for group {g0['group']} "
                f"(block size {g0['block_size']}) while remote_num_tokens={tr.remote_num_tokens} needs "
                f"{g0['blocks_needed']}; the trailing block(s) {g0['extra_blocks']} are spec-decode lookahead "
                f"reservations. {checked}, but any D that allocates fewer blocks than P reports end-trims "
                f"remote[-n:] and shifts the block mapping (the fix clips to the blocks covering the computed "
                f"tokens per attention group)."
            )
            findings.append(Finding(
                kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_WARNING, req=tr.req,
                step=p.get("step"), inst=p.get("inst"), event_ids=tr.event_ids(),
                title=title, explanation=expl, data=data))
    return findings
