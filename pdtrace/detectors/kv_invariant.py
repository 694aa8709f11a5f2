"""kv-invariant (issue 59): a step read KV that is not the request's own.

One invariant over the KV cache model (``kv_model``), with no rule per bug: every block a step
attends to for a request holds that request's token positions, written by a forward, a completed
transfer or a prefix-cache hit, and not re-owned or overwritten since. A read that breaks it is an
error with the block's chain of custody: the block, group and positions, what they should hold,
what they hold, who wrote that and when, and where the content came from through a transfer (P's
block, who had written it, P's free of it and P's lease running out where the trace has them).

``mechanism`` in a finding's data says what the chain shows, from the chain alone:

- ``shifted``: a transfer put another token block of the same prompt into the block;
- ``p-unwritten``: the transfer's source block held nothing P had written for that prompt (P
  reported a block it never wrote);
- ``reused``: the source block held another prompt's KV, and P had freed it before the read;
- ``foreign``: the block holds another prompt's KV (written on this instance, or on P while P held it);
- ``short``: the block holds the request's block, but not every position read was written;
- ``not-loaded``: the block was handed to the request for a KV load that never landed in it
  (a group no transfer wrote: vLLM #54926's shape);
- ``failed-load``: the block's load failed (a failed NIXL read, ``invalid_block_ids``);
- ``null-block``: the request's list names vLLM's null block at a position its sliding window or
  attention chunk still reads (pruned too early: vLLM #47282's shape, or a chunk-boundary prompt);
- ``unwritten``: the block was handed to the request and nothing wrote it before the read;
- ``write-outside``: the drafter wrote KV past the blocks the request holds (``spec.window``);
- ``in-flight``: a step in flight when a load was reported failed read the failed blocks, and its
  token was kept (``kvload.output``).

Root causes (``causes.group``): where a finding of another class names the same request, the
invariant's finding joins that cause (one bug, one headline); else it stands under
"kv-invariant/<mechanism>".
"""

from __future__ import annotations

import weakref
from typing import Any

from .base import KV_INVARIANT, SEVERITY_ERROR, Finding
from .index import feed_all
from .kv_model import AWAITING, FAILED, KINDS, PENDING, UNWRITTEN, Model
from .kv_state import block_size
from .kv_transfers import PUSHED, READ

Event = dict[str, Any]
KEPT = 1 << 14  # flagged requests remembered (one finding per request)


def _short(k: Any) -> str:
    return str(k)[:8] if k else "?"


class Stream:
    """The invariant over the model, fed in trace order. One finding per request: its first read
    that breaks the invariant (the count of bad blocks in that read, per group)."""

    KINDS = KINDS

    def __init__(self, header: dict | None = None):
        me = weakref.ref(self)  # (no cycle through the model: freed by refcount, not by a full GC pass over it)
        self.model = Model(lambda *a, **k: me()._report(*a, **k))  # type: ignore[union-attr]
        self.findings: list[Finding] = []
        self.flagged: dict[tuple, Any] = {}  # (scheduler, request) -> the mechanism of its finding
        self.model.mech_of = lambda s, r: (me().flagged.get((s.key, r.req)) if me() is not None else None)
        self.unjudged: dict[str, int] = {}  # why -> reads not judged

    def feed(self, idx: Any) -> None:
        self.model.feed(idx)

    def finish(self) -> list[Finding]:
        out, self.findings = self.findings, []
        return out

    def notes(self) -> list[dict]:
        c = self.model.counts
        return [{"reads_checked": c["reads"], "transfers": c["transfers"], "unjudged": c["unjudged"],
                 "digests_compared": {str(g): n for g, n in sorted(self.model.digest_counts.items())},
                 "digest": self.model.digest_notes(),
                 "unjudged_why": dict(self.unjudged), "drafter_windows": c["windows"], "window_edge_null": c["edge"],
                 "lease_intact": self.model.lease_intact(), "lease_unread": self.model.lease_unread()}]

    # --- the model's reports ------------------------------------------------------------------
    def _report(self, what: str, s: Any, r: Any, **kw: Any) -> None:
        if what == "unjudged":
            why = kw["why"]
            self.unjudged[why] = self.unjudged.get(why, 0) + 1
            return
        if what == "digest":
            self._digest(s, r, kw["e"], kw["bad"], kw["p_req"], kw["p_ev"], kw["mech"])
            return
        key = (s.key, r.req)
        if key in self.flagged:
            return
        self.flagged[key] = "?"
        n = len(self.findings)
        self._dispatch(what, s, r, kw)
        if len(self.findings) > n:
            self.flagged[key] = (self.findings[-1].data or {}).get("mechanism")

    def _dispatch(self, what: str, s: Any, r: Any, kw: dict) -> None:
        if len(self.flagged) > KEPT:
            del self.flagged[next(iter(self.flagged))]
        if what == "in-flight":
            self._in_flight(s, r, kw["e"], kw["held"], kw["handled"])
        elif what == "in-flight-write":
            self._in_flight_write(s, r, kw["e"], kw["hazards"])
        elif what == "in-flight-read":
            self._in_flight_read(s, r, kw["e"], kw["loader"], kw["hazards"])
        elif what == "window":
            self._window(s, r, kw["e"], kw["group"], kw["cap"])
        else:
            self._read(s, r, kw["e"], kw["bad"], kw["computed"])

    def _read(self, s: Any, r: Any, e: Event, bad: list, c: int) -> None:
        g, b, i, lo, hi, blk = bad[0]
        bs = block_size(s.cfg, g)
        pos = (i * bs + lo, i * bs + hi - 1)
        mech, holds, chain = self._chain(s, r, g, i, lo, hi, blk, bs)
        groups = sorted({x[0] for x in bad})
        data = {"mechanism": mech, "group": g, "group_kind": _kind(s, g), "block": b, "index": i,
                "positions": list(pos), "computed": c, "holds": holds, "chain": chain,
                "bad_blocks": [[x[0], x[1], x[2]] for x in bad], "group_ids": groups}
        if r.remote[0]:
            data["p_req"] = r.remote[0]
        ids = sorted({x for x in [r.ids.get("alloc"), *(st.get("ev") for st in chain), e.get("id")]
                      if isinstance(x, int)})
        more = f" (and {len(bad) - 1} more block(s))" if len(bad) > 1 else ""
        title = (f"{r.req} read KV that is not its own: group {g} block {b} (positions {pos[0]}-{pos[1]}) "
                 f"holds {holds}{more}")
        why = (f"At step {e.get('step')} on {s.inst or '?'}, {r.req} had {c} tokens computed, so its attention read "
               f"positions {pos[0]}-{pos[1]} from block {b} of KV cache group {g} ({_kind(s, g)}), its token block "
               f"{i}. That block should hold those positions of {r.req}'s prompt ({_short(r.key)}); it holds "
               f"{holds}. How it came to: " + "; ".join(st["what"] for st in chain) + ".")
        self.findings.append(Finding(KV_INVARIANT, SEVERITY_ERROR, r.req, e.get("step"), s.inst, ids, title, why,
                                     data))

    def _in_flight(self, s: Any, r: Any, e: Event, held: list, handled: int) -> None:
        g, b, i = held[0]
        data = {"mechanism": "in-flight", "group": g, "group_kind": _kind(s, g), "block": b, "index": i,
                "in_flight_step": e.get("step"), "rollback_step": e.get("rollback_step"),
                "bad_blocks": [list(x) for x in held], "group_ids": sorted({x[0] for x in held}),
                "chain": [{"what": "reported failed to load (kvload.handled)", "ev": handled},
                          {"what": f"step {e.get('step')}, scheduled before that, read it and its token was "
                                   f"appended after the rollback (kvload.output)", "ev": e.get("id")}]}
        self._error(s, r, e.get("step"), (handled, e.get("id")),
            f"{r.req} read KV that is not its own: step {e.get('step')} read group {g} block {b}, which failed to "
            f"load, and its token was kept",
            f"Step {e.get('step')} was scheduled before the failed load of block {b} (group {g}, token block {i}) was "
            f"reported; it read the block as the load left it, and its sampled token was appended to "
            f"{r.req}'s output after the rollback.", data)

    def _in_flight_write(self, s: Any, r: Any, e: Event, hazards: list) -> None:
        """``r``'s blocks to load from P were handed to it while a step still in flight writes another request's
        KV into them, at offsets the load fills: the NIXL read lands by RDMA, unordered against that forward."""
        g, i, b, loaded, stale, freed = hazards[0]
        step, wreq, lo, hi, sev, wi = stale[0]
        bs = block_size(s.cfg, g)
        chain = [{"what": f"step {step} (event {sev}) was scheduled to write {wreq}'s positions at offsets {lo}-{hi - 1} "
                          f"of block {b}; its output was not processed yet", "ev": sev}]
        if freed is not None and freed[0] == wreq:
            chain.append({"what": f"{wreq} was freed (event {freed[1]}) while step {step} was in flight", "ev": freed[1]})
        chain.append({"what": f"handed to {r.req} to load {loaded} position(s) from P (event {e.get('id')}), offsets "
                              f"0-{loaded - 1}: the NIXL read lands there, unordered against step {step}'s write",
                      "ev": e.get("id")})
        data = {"mechanism": "in-flight-write", "group": g, "group_kind": _kind(s, g), "block": b, "index": i,
                "positions": [i * bs + lo, i * bs + min(hi, loaded) - 1], "writer": wreq, "in_flight_step": step,
                "bad_blocks": [[x[0], x[2], x[1]] for x in hazards], "group_ids": sorted({x[0] for x in hazards}),
                "chain": chain}
        if r.remote[0]:
            data["p_req"] = r.remote[0]
        ids = sorted({x for x in [sev, freed[1] if freed else None, e.get("id")] if isinstance(x, int)})
        more = f" (and {len(hazards) - 1} more block(s))" if len(hazards) > 1 else ""
        self.findings.append(Finding(
            KV_INVARIANT, SEVERITY_ERROR, r.req, e.get("step"), s.inst, ids,
            f"{r.req} loads KV from P into block {b}, which step {step}, still in flight, writes for {wreq}{more}",
            f"{wreq}'s blocks were freed and handed to {r.req} while step {step}, scheduled before {wreq} finished "
            f"(async scheduling), was still in flight: its forward writes {wreq}'s KV for its positions "
            f"{wi * bs + lo}-{wi * bs + hi - 1} into offsets {lo}-{hi - 1} of block {b} (group {g}, {_kind(s, g)}), "
            f"which in {r.req} are token positions "
            f"{i * bs + lo}-{i * bs + min(hi, loaded) - 1} of the KV it loads from P. The NIXL read lands by RDMA, not "
            f"ordered against the compute stream, so the stale write can land after it: {r.req} then decodes on "
            f"{wreq}'s KV there. How it came to: " + "; ".join(c["what"] for c in chain) + ".", data))

    def _in_flight_read(self, s: Any, r: Any, e: Event, loader: str, hazards: list) -> None:
        """A block ``r``'s window still reads in a step in flight was pruned from ``r`` and handed to ``loader``'s
        KV load: the NIXL read lands by RDMA under that step's attention (vLLM #47282)."""
        g, i0, b, step, lo, hi, i, loaded, sev = hazards[0]
        bs = block_size(s.cfg, g)
        win = s.group(g)[2]
        chain = [{"what": f"step {step} was scheduled for {r.req} with its window ({win} tokens) reaching positions "
                          f"{i0 * bs + lo}-{i0 * bs + hi - 1} of block {b} (its token block {i0}); its output was not "
                          f"processed yet (event {sev})", "ev": sev},
                 {"what": f"vLLM pruned block {b} from {r.req}'s window: the block went to another request while "
                          f"{r.req} still ran (a running request's pruning is not recorded; its list only grows in "
                          f"the trace)", "ev": None},
                 {"what": f"handed to {loader} to load {loaded} position(s) from P (event {e.get('id')}), offsets "
                          f"0-{loaded - 1}: the NIXL read lands there, unordered against step {step}'s attention",
                  "ev": e.get("id")}]
        data = {"mechanism": "in-flight-read", "group": g, "group_kind": _kind(s, g), "block": b, "index": i0,
                "positions": [i0 * bs + lo, i0 * bs + min(hi, loaded) - 1], "loader": loader, "in_flight_step": step,
                "window": win, "bad_blocks": [[x[0], x[2], x[1]] for x in hazards],
                "group_ids": sorted({x[0] for x in hazards}), "chain": chain}
        ids = sorted({x for x in [r.ids.get("alloc"), sev, e.get("id")] if isinstance(x, int)})
        more = f" (and {len(hazards) - 1} more)" if len(hazards) > 1 else ""
        self.findings.append(Finding(
            KV_INVARIANT, SEVERITY_ERROR, r.req, step, s.inst, ids,
            f"{r.req}'s step {step}, still in flight, reads block {b}, which was handed to {loader}'s KV load{more}",
            f"Under async scheduling vLLM pruned block {b} (group {g}, {_kind(s, g)}, {r.req}'s token block {i0}) from "
            f"{r.req}'s sliding window while step {step}, scheduled before, still read it: that step's window reaches "
            f"positions {i0 * bs + lo}-{i0 * bs + hi - 1}. The block went back to the pool and to {loader}, which loads "
            f"KV from P into offsets 0-{loaded - 1}; the NIXL read lands by RDMA, not ordered against step {step}'s "
            f"attention, so {r.req}'s token there can be computed on {loader}'s KV. vLLM #47282: 0.19-0.25 prune by "
            f"the optimistic num_computed_tokens; 0.26 (PR #47728) by the tokens whose steps were processed. "
            "How it came to: " + "; ".join(c["what"] for c in chain) + ".", data))

    def _digest(self, s: Any, r: Any, e: Event, bad: list, p_req: Any, p_ev: Any, mech: Any) -> None:
        """``record --kv-checksum``: the bytes D's first forward read differ from the bytes P's block held when
        P's request was final. The mechanism the model gave the request, where it gave one (one bug, one cause)."""
        g, lb, rb, dd, pd, took = bad[0]
        data = {"mechanism": mech if mech not in (None, "?") else "digest-differs", "digest": True, "group": g,
                "group_kind": _kind(s, g), "block": lb, "p_block": rb, "read_from": took, "p_req": p_req,
                "d_digest": dd, "p_digest": pd, "bad_blocks": [[x[0], x[1], None] for x in bad],
                "group_ids": sorted({x[0] for x in bad}),
                "chain": [{"what": f"P's digest of block {rb} when {p_req} was final (event {p_ev})", "ev": p_ev},
                          {"what": f"D's digest of block {lb} before its first forward read it (event {e.get('id')})",
                           "ev": e.get("id")}]}
        more = f" (and {len(bad) - 1} more block(s))" if len(bad) > 1 else ""
        read = ("the block D's transfer read" if took == rb else
                f"which holds that token position in {p_req}'s own list (D's transfer read P's block {took} instead)")
        self._error(s, r, e.get("step"), (p_ev, e.get("id")),
            f"the KV {r.req} decoded on differs from what P computed: group {g} block {lb} (P's block {rb} of "
            f"{p_req}){more}",
            f"record --kv-checksum: D's digest of block {lb} (group {g}, {_kind(s, g)}) before {r.req}'s first forward "
            f"({dd}) differs from P's digest of block {rb}, {read}, when {p_req}'s KV was final "
            f"({pd}): the bytes D decoded on are not the bytes P computed for these positions of the prompt."
            + (f" The KV model names the mechanism: {mech}." if mech not in (None, "?") else ""), data)

    def _error(self, s: Any, r: Any, step: Any, ids: tuple, title: str, why: str, data: dict) -> None:
        self.findings.append(Finding(KV_INVARIANT, SEVERITY_ERROR, r.req, step, s.inst,
                                     sorted(x for x in ids if isinstance(x, int)), title, why, data))

    def _window(self, s: Any, r: Any, e: Event, g: int, cap: int) -> None:
        a, z = int(e.get("start") or 0), int(e.get("end") or 0)
        data = {"mechanism": "write-outside", "group": g, "group_kind": _kind(s, g), "window": [a, z],
                "allocated_positions": cap, "method": e.get("method"), "group_ids": [g],
                "chain": [{"what": f"{r.req} holds blocks for positions 0-{cap - 1} (event {r.ids.get('alloc')})",
                           "ev": r.ids.get("alloc")},
                          {"what": f"its {e.get('method') or ''} drafter wrote KV at positions {a}-{z - 1} "
                                   f"(spec.window)", "ev": e.get("id")}]}
        self.findings.append(Finding(
            KV_INVARIANT, SEVERITY_ERROR, r.req, e.get("step"), s.inst,
            sorted(x for x in (r.ids.get("alloc"), e.get("id")) if isinstance(x, int)),
            f"{r.req}'s drafter wrote KV into blocks that are not its own: positions {max(a, cap)}-{z - 1} of group "
            f"{g}, past its {cap} allocated positions",
            f"The {e.get('method') or ''} drafter wrote KV for {r.req} at positions {a}-{z - 1} in step "
            f"{e.get('step')}, but the request holds blocks for positions 0-{cap - 1} only in KV cache group {g} "
            f"({_kind(s, g)}): the positions past them are written through block-table entries the request does "
            f"not own, into whatever blocks those name.", data))

    def _chain(self, s: Any, r: Any, g: int, i: int, lo: int, hi: int, blk: Any, bs: int) -> tuple:
        """(mechanism, what the block holds in words, the chain of custody: [{what, ev}])."""
        chain: list[dict] = []
        if blk is None:  # the request's list names vLLM's null block at a position its window still reads
            chain.append({"what": f"{r.req}'s block list has vLLM's null block (0) at token block {i}, inside the "
                                  f"{_kind(s, g)} window its step attends to (event {r.ids.get('alloc')}, and later "
                                  f"allocations)", "ev": r.ids.get("alloc")})
            return "null-block", "nothing: it is vLLM's null block (the window's positions were pruned)", chain
        if blk.owner is not None:
            chain.append({"what": f"handed to {blk.owner} (event {blk.own_ev})", "ev": blk.own_ev})
        label, how, src = blk.label, blk.how, blk.src
        if blk.under is not None and blk.lo > lo:
            label, how, ev, src, _l, _h = blk.under
            chain.append({"what": f"{r.req}'s own forward wrote it only from position {i * bs + blk.lo} on "
                                  f"(event {blk.ev})", "ev": blk.ev})
        if src is not None:  # a NIXL read: D's block took what P's block held
            p = src.p
            by = "P's NIXL write (push)" if how.startswith(PUSHED) else "D's NIXL read"
            chain.append({"what": f"{by} {src.read} filled it from {src.inst or 'P'}'s "
                                  f"block {src.block} of {src.req}", "ev": src.read})
            if src.not_its is not None:
                chain.append({"what": f"P never gave block {src.block} to {src.req} (its blocks: {src.not_its}): D's "
                                      f"transfer named a block that is not the request's", "ev": src.read})
            if how not in (READ, PUSHED):
                return "failed-load", f"a failed load ({how})", chain
            if p is None:
                return "unjudged", "a P block the trace does not show", chain
            return self._from_p(r, g, i, lo, hi, p, src, chain, bs)
        return self._local(r, g, i, lo, hi, label, how, blk, chain, bs)

    def _from_p(self, r: Any, g: int, i: int, lo: int, hi: int, p: Any, src: Any, chain: list, bs: int) -> tuple:
        label = p.label
        m = self.model
        if p.ev is not None:
            by = f" of {p.owner}" if p.owner and p.owner != src.req else ""
            chain.append({"what": f"P's block held {_words(label, m, r)} ({p.how or 'state'}{by} at event {p.ev}"
                                  f"{', step ' + str(p.step) if p.step is not None else ''})", "ev": p.ev})
        elif p.owner is not None:
            chain.append({"what": f"P had handed that block to {p.owner} (event {p.own_ev}), which never wrote it",
                          "ev": p.own_ev})
        freed = p.freed
        p_req = src.req
        lease = m.expired.get(str(p_req)) if p_req else None
        if lease is not None:
            chain.append({"what": f"P's lease on {p_req} ran out (event {lease})", "ev": lease})
        if freed is not None and freed[0] == p_req:
            chain.append({"what": f"P freed it from {p_req} (event {freed[1]}) before D's read", "ev": freed[1]})
        if type(label) is not tuple:
            return "p-unwritten", f"nothing P wrote for that prompt ({label} on P)", chain
        if m.same(label, (r.key, g, i)):
            return "short", f"positions {i * bs + p.lo}-{i * bs + p.hi - 1} only", chain
        if label[0] is not None and m.same((label[0], g, label[2]), (r.key, g, label[2])) or label[0] == r.key:
            return "shifted", f"token block {label[2]} of the same prompt", chain
        if lease is not None or (freed is not None and freed[0] == p_req):
            return "reused", f"another prompt's KV ({_short(label[0])}, token block {label[2]})", chain
        return "foreign", f"another prompt's KV ({_short(label[0])}, token block {label[2]})", chain

    def _local(self, r: Any, g: int, i: int, lo: int, hi: int, label: Any, how: str, blk: Any, chain: list,
               bs: int) -> tuple:
        m = self.model
        if label == AWAITING:
            chain.append({"what": "allocated for a KV load, but not among the blocks D's connector loads into "
                                  "(nixl.remote_alloc)", "ev": blk.ev})
            return "not-loaded", "nothing: no KV load was planned into it", chain
        if label == PENDING:
            chain.append({"what": "D's connector was to load it; no NIXL read of it landed", "ev": blk.ev})
            return "not-loaded", "nothing: its KV load never landed", chain
        if label == FAILED:
            chain.append({"what": f"{how} (event {blk.ev})", "ev": blk.ev})
            return "failed-load", "a load that failed", chain
        if label == UNWRITTEN or type(label) is not tuple:
            return "unwritten", "nothing written since it was handed out", chain
        chain.append({"what": f"{how or 'written'} of {_words(label, m, r)} at event {blk.ev}", "ev": blk.ev})
        if blk.freed is not None:
            chain.append({"what": f"freed by {blk.freed[0]} (event {blk.freed[1]})", "ev": blk.freed[1]})
        if m.same(label, (r.key, g, i)):
            return "short", f"positions {i * bs + blk.lo}-{i * bs + blk.hi - 1} only", chain
        if label[0] == r.key:
            return "shifted", f"token block {label[2]} of the same prompt", chain
        return "foreign", f"another prompt's KV ({_short(label[0])}, token block {label[2]})", chain


def _words(label: Any, m: Model, r: Any) -> str:
    if type(label) is not tuple:
        return f"no content ({label})"
    same = label[0] == r.key or (r.key is not None and m.same((label[0], label[1], label[2]), (r.key, label[1], label[2])))
    return f"token block {label[2]} of {'the same' if same else 'another'} prompt ({_short(label[0])})"


def _kind(s: Any, g: int) -> str:
    kinds = s.cfg.get("group_kinds") or []
    return str(kinds[g]) if g < len(kinds) else "?"


def _bytes_said(n: dict) -> list[str]:
    """record --kv-checksum: the blocks compared per group, and what was not compared and why (never "clean")."""
    d = n.get("digest") or {}
    if not d.get("setup") and not n.get("digests_compared"):
        return []
    every = d.get("every", 1)
    how = "record --kv-checksum" + (f"-every {every}: one request in {every}" if every > 1 else "")
    blocks = ", ".join(f"{k} block(s) in group {g}" for g, k in (n.get("digests_compared") or {}).items())
    out = [f"KV bytes compared ({how}): " + (blocks or "none")
           + f"; {d.get('requests', 0)} of {d.get('transfers', 0)} loaded request(s) compared"]
    if every > 1:
        out.append(f"the others not sampled (one in {every})")
    if d.get("no_p"):
        out.append(f"{d['no_p']} D digest(s) whose P digest is not in the trace (P recorded without --kv-checksum, "
                   f"or its request not sampled there)")
    if d.get("no_layers"):
        out.append(f"no KV layer digested on {', '.join(d['no_layers'])}")
    if d.get("skipped"):
        out.append("not digested: " + "; ".join(d["skipped"]))
    if d.get("sliding") and d.get("setup"):
        out.append(f"sliding-window group(s) {', '.join(map(str, d['sliding']))}: only the blocks in the window are "
                   f"loaded, so only those are compared")
    if d.get("apart"):
        out.append("not compared, the KV layouts differ: " + "; ".join(d["apart"]))
    return out


def coverage(cov: dict[str, Any], notes: dict[str, list]) -> dict[str, Any]:
    """The class's coverage verdict given what the stream could not judge: reads of KV whose content
    the trace cannot tell (a transfer from a P instance not in the trace, a load no worker event
    says landed) leave it "not checked", with how many and why; never "clean"."""
    c = cov.get(KV_INVARIANT)
    n = (notes.get(KV_INVARIANT) or [{}])[0] if notes.get(KV_INVARIANT) else {}
    if c is None or c.status != "checked" or not n:
        return cov
    if not n.get("unjudged"):  # what it judged, said beside the verdict
        said = [f"{n.get('reads_checked', 0)} block read(s) judged", f"{n.get('transfers', 0)} NIXL transfer(s) followed"]
        if n.get("drafter_windows"):
            said.append(f"{n['drafter_windows']} drafter window(s)")
        said += _bytes_said(n)
        if n.get("window_edge_null"):
            said.append(f"{n['window_edge_null']} read(s) reached one position of vLLM's null block at a window's "
                        f"leading edge (a recomputed last token; a fact, see docs/kv-invariant.md)")
        out = dict(cov)
        out[KV_INVARIANT] = type(c)(KV_INVARIANT, "checked", "; ".join([c.reason] * bool(c.reason) + said),
                                    c.events, c.hook_errors)
        return out
    why = "; ".join(f"{k} ({v})" for k, v in sorted((n.get("unjudged_why") or {}).items(), key=lambda x: -x[1]))
    out = dict(cov)
    out[KV_INVARIANT] = type(c)(KV_INVARIANT, "not-checked",
                                f"{n['unjudged']} of {n.get('reads_checked', 0)} block reads could not be judged: {why}; "
                                f"the other reads were judged, and any finding on them stands", c.events,
                                c.hook_errors)
    return out


def judged(events: list[Event]) -> dict[str, list]:
    """The stream's facts over a loaded event list (``coverage.coverage``): what it judged and could not."""
    st = Stream()
    feed_all(st, events)
    return {KV_INVARIANT: st.notes()}


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)
