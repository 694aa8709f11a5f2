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
covering the same token range. ``join_transfers`` is shared with ``pdtrace.detectors.whatif``.
"""

from __future__ import annotations

from typing import Any

from .base import LOOKAHEAD_MISALIGNMENT, SEVERITY_ERROR, SEVERITY_INCONCLUSIVE, SEVERITY_WARNING, Finding
from .index import feed_all
from .transfers import Joiner, Transfer, _make, blocks_needed, end_trim, is_tail_group, join_transfers  # noqa: F401
from .uneven_trim import finding as uneven_finding, uneven_groups

Event = dict[str, Any]


_NO_TAIL_PAIRS = "in-window tail and no trim or read of D's in the trace: what D paired is not recorded"


def analyze_group(tr: Transfer, g: int) -> dict[str, Any]:
    """Per-group verdict data: needed/extra blocks and each recorded pair checked by token range.

    D's local block i of n covers token block ``needed - n + i`` (D loads the uncomputed
    suffix; sliding-window / chunked-local groups exchange only their in-window tail, which
    ends at the same token block). The P block that holds those tokens is P's allocation
    at that index (``allocated_block_ids``, null blocks included); for a full-attention
    group without P's allocation, P's report read from token block 0. A sliding-window
    group without P's allocation, or any group when no token count is known, is not judged
    (``judged: False``, ``why``). State groups (Mamba / SSM) are passed through, never judged.
    """
    B = tr.block_size(g)
    R = tr.reported[g] if g < len(tr.reported) else []
    attention = tr.is_attention(g)
    kind = tr.group_kind(g)
    tail = is_tail_group(kind)
    rnt = tr.remote_num_tokens
    A = None
    if tr.p_finished is not None:
        alloc = tr.p_finished.get("allocated_block_ids") or []
        A = alloc[g] if g < len(alloc) else None
    needed = blocks_needed(rnt, B) if rnt is not None else None
    info: dict[str, Any] = {
        "group": g, "group_kind": kind, "state_group": not attention, "tail_only": tail,
        "block_size": B, "remote_num_tokens": rnt, "blocks_needed": needed,
        "reported": R, "extra_blocks": [], "pairs": [], "mismatches": 0, "shift": None,
        "judged": attention, "why": "" if attention else "state group: passed through",
    }
    if not attention:
        return info
    if needed is None:
        info["judged"], info["why"] = False, "no token count: remote_num_tokens missing, no P side"
    elif A is None and tail:
        info["judged"], info["why"] = False, "in-window tail reported and P's allocation not in the trace"
    elif tail and tr.mapping_source == "inferred":  # (D's whole list is not what the connector clips to send)
        info["judged"], info["why"] = False, _NO_TAIL_PAIRS
    if not info["judged"]:
        return info
    assert needed is not None
    truth = A if A is not None else R
    pos_in_truth: dict[int, int] = {}
    for j, b in enumerate(truth):
        pos_in_truth.setdefault(b, j)
    info["extra_blocks"] = [b for b in R if pos_in_truth.get(b, -1) >= needed]
    if tr.mapping is None or g >= len(tr.mapping):
        return info
    pairs = tr.mapping[g]
    L = (tr.local[g] if tr.local is not None and g < len(tr.local) and tr.local[g] and tr.local_known(g)
         else [lb for lb, _ in pairs])  # (a list the trace cannot cut as the connector did: what D read)
    pos_of = {lb: i for i, lb in enumerate(L)}
    n = len(L)
    first = needed - n if n <= needed else 0
    held = _held_positions(tr, g, L, tail)
    if held is not None:  # D's own list says where each local block sits (vLLM's block list, not an assumption)
        info["positions"] = "D's block list (sched.alloc)"
    if n > len(R) and tr.mapping_source != "inferred" and tr.local_known(g):  # vLLM #50558: the trim asserts
        info["unpaired_local"] = ([lb for lb in L if held[lb] >= needed] if held is not None else []) or L[len(R):]
        info["mismatches"] += len(info["unpaired_local"])
    shifts = set()
    for k, (lb, rb) in enumerate(pairs):
        i = pos_of.get(lb, k)
        gi = held[lb] if held is not None else first + i
        expected = truth[gi] if 0 <= gi < min(needed, len(truth)) else None
        beyond = held is not None and gi >= needed  # D's block holds tokens P never computed
        shift = None
        if (expected is not None and rb != expected) or beyond:
            info["mismatches"] += 1
            j = pos_in_truth.get(rb)
            shift = (j - gi) if j is not None else None
            shifts.add(shift)
        info["pairs"].append({
            "local_index": gi if held is not None else i, "local": lb, "remote": rb, "expected": expected,
            "tokens": [gi * B, min((gi + 1) * B, rnt)] if expected is not None else [gi * B, (gi + 1) * B],
            "ok": not beyond and (expected is None or rb == expected), "shift": shift, "beyond": beyond,
        })
    known = sorted(x for x in shifts if x is not None)
    if known:
        info["shift"] = known[0] if len(known) == 1 and None not in shifts else known
    return info


def _held_positions(tr: Transfer, g: int, L: list[int], tail: bool) -> dict[int, int] | None:
    """Each local block's token-block index in D's own block list (``transfers._positions``: only
    where the blocks are that list's unhashed suffix), not for in-window tail groups, whose lists
    are cut."""
    if tail or not L or tr.d_positions is None or g >= len(tr.d_positions):
        return None
    return tr.d_positions[g]


def _flagged(tr: Transfer) -> bool:
    """Whether ``analyze_group`` finds mismatches or extra blocks in any group of ``tr``: the
    same arithmetic, without building the per-pair report (most transfers are fine)."""
    rnt = tr.remote_num_tokens
    if rnt is None:
        return True  # analyze_group says what it can (inconclusive)
    for g in range(len(tr.reported)):
        B = tr.block_size(g)
        if not tr.is_attention(g):
            continue
        if is_tail_group(tr.group_kind(g)):
            return True  # tail-only lists: the token-range mapping in analyze_group decides
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
        if n > len(R) and tr.mapping_source != "inferred" and tr.local_known(g):
            return True  # local > remote (vLLM #50558)
        held = _held_positions(tr, g, L, False)
        if held is not None and (held[L[0]] != first or held[L[-1]] >= needed):
            return True  # D's list places its blocks elsewhere than the count rule assumes
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


class Stream:
    """The detector over events fed in trace order (``feed`` one ``Index`` of consecutive
    events at a time, then ``finish``): each transfer is judged when ``transfers.Joiner``
    completes it."""

    KINDS = Joiner.KINDS  # (what it reads, besides the configs)

    def __init__(self, header: dict | None = None):
        self.findings: list[Finding] = []
        self.joiner = Joiner(self._judge)

    def feed(self, idx: Any) -> None:
        self.joiner.feed(idx)

    def _judge(self, p: Event | None, a: Event | None, ctx: tuple) -> None:
        f = judge(self.joiner.configs, p, a, ctx)
        if f is not None:
            self.findings.append(f)

    def finish(self) -> list[Finding]:
        self.joiner.finish()
        return self.findings


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


def judge(idx: Any, p: Event | None, a: Event | None, ctx: tuple) -> Finding | None:
    """The finding on one transfer (P's report ``p``, D's allocation ``a``, ``ctx`` from the
    ``Joiner``), or None when it is fine."""
    uneven = uneven_groups(ctx[0])  # D's trim paired unequal lists: its read asserts
    if not uneven and not _flagged(_make(idx, p, a, *ctx, copy=False)):  # most transfers are fine
        return None
    tr = _make(idx, p, a, *ctx)
    if uneven:
        return uneven_finding(tr, uneven)
    groups = [analyze_group(tr, g) for g in range(len(tr.reported))]
    bad = [gi for gi in groups if gi["mismatches"]]
    latent = [gi for gi in groups if gi["extra_blocks"]]
    open_ = [gi for gi in groups if not gi["judged"] and not gi["state_group"] and _trimmed(tr, gi["group"])
             and gi["why"] != _NO_TAIL_PAIRS]
    if not bad and not latent and not open_:
        return None
    data = {
        "p_req": tr.p_req, "d_req": tr.d_req, "remote_num_tokens": tr.remote_num_tokens,
        "prompt_len": (tr.p_finished or {}).get("prompt_len"),
        "mapping_source": tr.mapping_source, "tokens_source": tr.tokens_source, "groups": groups,
    }
    if bad:
        step_ev = (tr.reads[0] if tr.reads else tr.trim or tr.d_alloc) or {}
        g0 = bad[0]
        foreign = [p for p in g0["pairs"] if p["remote"] not in g0["reported"]]
        if foreign:  # D read blocks P never reported for the request: its params name other blocks
            return _not_reported(tr, g0, foreign, step_ev, len(bad), data)
        if not g0["extra_blocks"]:  # nothing of P's lookahead: D's list is off P's tokens (#50558)
            return _past_p(tr, g0, step_ev, len(bad), data)
        wrong = [p for p in g0["pairs"] if not p["ok"]]
        w = wrong[0]
        sh = g0["shift"]
        shift_txt = (f"shift {sh:+d}" if isinstance(sh, int) else
                     "shifts " + "/".join(f"{x:+d}" for x in sh) if sh else "not a shift of P's blocks")
        title = (f"request {tr.req}: D block {w['local']} read P block {w['remote']} instead of "
                 f"{w['expected']} (group {g0['group']}, {shift_txt})")
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
            + (f". The mapping is shifted by {sh:+d} block(s)" if isinstance(sh, int) else
               f". The mapping is off ({shift_txt})")
            + f": D attends to KV P never wrote for these tokens. {len(bad)} group(s) affected."
        )
        return Finding(
            kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_ERROR, req=tr.req,
            step=step_ev.get("step"), inst=step_ev.get("inst", "D"), event_ids=tr.event_ids(),
            title=title, explanation=expl, data=data)
    elif not latent:
        return _inconclusive(tr, open_, data)
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
        return Finding(
            kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_WARNING, req=tr.req,
            step=p.get("step"), inst=p.get("inst"), event_ids=tr.event_ids(),
            title=title, explanation=expl, data=data)


def _not_reported(tr: Transfer, g0: dict, foreign: list, step_ev: Event, n_bad: int, data: dict) -> Finding:
    """D read P blocks that are not in the list P reported for the request: the transfer's remote block ids are
    another request's, or out of range (vLLM #52234's table: params that name blocks P never gave the request).
    What D's lists and P's hold, not how many: the two lists may be of one length."""
    ids = [p["remote"] for p in foreign]
    title = (f"request {tr.req}: D read P block(s) {ids[:6]}{' ...' if len(ids) > 6 else ''}, which P did not report "
             f"for it (P reported {g0['reported']}, group {g0['group']})")
    n = f"{tr.remote_num_tokens} tokens" if tr.remote_num_tokens is not None else "its token count not recorded"
    expl = (f"P reported block(s) {g0['reported']} for {tr.p_req or 'the request'} ({n}, "
            f"group {g0['group']}), but D's transfer read "
            + "; ".join(f"D block {p['local']} (tokens {p['tokens'][0]}-{p['tokens'][1] - 1}) <- P block {p['remote']}"
                        for p in foreign[:4])
            + (f" (and {len(foreign) - 4} more)" if len(foreign) > 4 else "")
            + ": block ids P never gave that request. The transfer parameters D received (remote_block_ids) are "
              "not the ones P returned, so D loaded whatever those P blocks held (another request's KV, or "
              "nothing), and NIXL's read succeeds all the same: HTTP 200 on KV of other tokens. Whatever carried "
              f"the params from P to D (a router, a cache of params) is where they changed. {n_bad} group(s) affected.")
    return Finding(kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_ERROR, req=tr.req, step=step_ev.get("step"),
                   inst=step_ev.get("inst", "D"), event_ids=tr.event_ids(), title=title, explanation=expl,
                   data={**data, "not_reported": ids})


def _past_p(tr: Transfer, g0: dict, step_ev: Event, n_bad: int, data: dict) -> Finding:
    """D's local blocks against P's tokens when P reported no lookahead block: D's own block
    list places them past the tokens P computed (D's prompt is longer than P's), or D holds more
    blocks to load than P reported (vLLM #50558)."""
    unpaired = g0.get("unpaired_local") or []
    wrong = [p for p in g0["pairs"] if not p["ok"]]
    n_local = len(tr.local[g0["group"]]) if tr.local is not None else 0
    rnt, B = tr.remote_num_tokens, g0["block_size"]
    full = ((tr.d_alloc or {}).get("local_block_ids") or [[]])
    full_g = full[g0["group"]] if g0["group"] < len(full) else []
    past = len(full_g) - (g0["blocks_needed"] or 0)
    why = (f"D's own list for the request holds {len(full_g)} block(s) where P's {rnt} token(s) fill "
           f"{g0['blocks_needed']}" + (f": D's request reaches {past} block(s) past the tokens P computed (a proxy "
                                       f"that appends P's first sampled token to the prompt does this when the "
                                       f"prompt ends on a block boundary: vLLM #50558)" if past > 0 else ""))
    if unpaired and not [p for p in wrong if p["local"] not in unpaired]:
        title = (f"request {tr.req}: D holds {n_local} block(s) to load for group {g0['group']}, P reported "
                 f"{len(g0['reported'])}: D block(s) {unpaired} have no P block (local > remote)")
        expl = (f"D's trim got {n_local} block(s) to load and P's {g0['reported']} (block size {B}). {why}. "
                f"vLLM's _apply_prefix_caching assumes D never loads more blocks than P reports"
                + (f" and raised ({tr.raised}) in D's worker, uncaught in start_load_kv: D's engine step fails "
                   f"with it" if tr.raised else
                   "; here it paired them anyway, D's extra block(s) with nothing P wrote") + ".")
    else:
        w = wrong[0]
        lo, hi = w["tokens"]
        what = (f"P block {w['expected']}" if w["expected"] is not None else "no P block (P never computed them)")
        title = (f"request {tr.req}: D block {w['local']} (tokens {lo}-{hi - 1}) read P block {w['remote']}; "
                 f"those tokens are in {what} (group {g0['group']})")
        expl = (f"D's own block list puts its local block(s) at token blocks "
                f"{sorted(p['local_index'] for p in g0['pairs'])} (block size {B}); P reported {g0['reported']} for "
                f"{rnt} tokens. D paired them by count from the end of P's list (the end-trim assumes D's blocks end "
                f"where P's tokens end), so "
                + "; ".join(f"D block {p['local']} (tokens {p['tokens'][0]}-{p['tokens'][1] - 1}) <- P block "
                            f"{p['remote']} instead of "
                            + (f"{p['expected']}" if p["expected"] is not None else "none: past P's tokens")
                            for p in wrong[:4])
                + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
                + f". {why}. D attends to KV of other tokens: silent corruption. {n_bad} group(s) affected.")
    return Finding(kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_ERROR, req=tr.req, step=step_ev.get("step"),
                   inst=step_ev.get("inst", "D"), event_ids=tr.event_ids(), title=title, explanation=expl,
                   data={**data, "unpaired_local": unpaired, "raised": tr.raised})


def _trimmed(tr: Transfer, g: int) -> bool:
    """D received more (or other) blocks than it loads into for group ``g``: it end-trims."""
    if tr.local is None:
        return False
    L = tr.local[g] if g < len(tr.local) else []
    R = tr.reported[g] if g < len(tr.reported) else []
    return len(R) != len(L)


def _inconclusive(tr: Transfer, groups: list[dict], data: dict) -> Finding:
    g0 = groups[0]
    a = tr.d_alloc or tr.p_finished or {}
    n_local = len(tr.local[g0["group"]]) if tr.local is not None and g0["group"] < len(tr.local) else 0
    if n_local > len(g0["reported"]):  # no trim happens there: vLLM asserts (#50558)
        title = (f"request {tr.req}: D holds {n_local} block(s) to load for group {g0['group']}, P reported "
                 f"{len(g0['reported'])} (local > remote); the trace does not say how many tokens P computed")
    else:
        title = (f"request {tr.req}: D end-trims P's {len(g0['reported'])} block(s) to its {n_local} for group "
                 f"{g0['group']}; whether that drops a cached prefix or lookahead block(s) is unknown")
    paired = ("D holds more blocks to load than P reported: vLLM's _apply_prefix_caching asserts on that "
              "(vLLM #50558; the trim is not recorded here) rather than trimming" if n_local > len(g0["reported"])
              else f"D paired its {n_local} local block(s) with the last {n_local} of P's {g0['reported']}")
    expl = (f"The trace does not say how many tokens P computed for this transfer ({g0['why']}): D's "
            f"kv_transfer_params carry no remote_num_tokens and nothing else in the trace gives it (P's "
            f"nixl.request_finished, or a num_external_tokens that covers every block). {paired}; with P's "
            f"token count the pairing could be checked. Inconclusive, not an error.")
    return Finding(kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_INCONCLUSIVE, req=tr.req, step=a.get("step"),
                   inst=a.get("inst"), event_ids=tr.event_ids(), title=title, explanation=expl,
                   data={**data, "tokens_source": tr.tokens_source})
