"""The KV model's transfers and failed loads (``kv_model.Model`` takes these handlers from ``Transfers``):
D's connector's load lists, NIXL reads (pull) and P's writes (push) and their completion, P's lease running out, the drafter's write window,
loads reported failed and what the scheduler did after them."""

from __future__ import annotations

from typing import Any

from .kv_state import AWAITING, FAILED, PENDING, Block, Src, block_size
from .transfer_lists import load_list

Event = dict[str, Any]
KEPT_P = 1 << 15  # P request ids remembered for the scheduler D reads from (the oldest go first)
READ, PUSHED = "NIXL read", "NIXL write (push)"  # how a loaded block got P's KV (a failure: how + " ERR")
KEPT_LANDED = 1 << 10  # reads that landed, kept for a second record of the same landing (0.32: DONE and ERR)


class Transfers:
    """The handlers of the transfer and failed-load events (a mixin of ``kv_model.Model``, whose state they
    change: ``scheds``, ``xfers``, ``expired``, ``counts``, ``report``)."""

    # --- transfers ------------------------------------------------------------------------------
    def _nixl_remote_alloc(self, e: Event) -> None:
        """D's connector says which of its blocks it loads into (per transfer group): those wait for
        the transfer (``PENDING``); the request's other blocks for the loaded tokens (a group outside
        the transfer) are never loaded and stay ``AWAITING``."""
        s = self.sched(e)
        r = s.reqs.get(str(e.get("req")))
        if r is None:
            return
        lists, exact = load_list(e, s.cfg)
        r.loads = all(exact)
        for lst in lists:
            for b in lst:
                blk = s.blocks.get(b)
                if blk is not None and blk.label == AWAITING:
                    blk.label = PENDING

    def _nixl_read(self, e: Event) -> None:
        r = self.req_of(e)
        rid = str(e.get("req"))
        p_key = self.by_engine.get(str(e.get("remote_engine"))) if e.get("remote_engine") else None
        p_req = e.get("remote_req") or (r.remote[0] if r is not None else None)
        if p_req is not None:  # (P's own id where D named it by the router's: request_ids)
            p_req = self.p_ids.match(str(p_req), self.p_of) or p_req
        if p_key is None and p_req is not None:
            p_key = (self.p_of.get(str(p_req)) or (None, None))[0]
        ps = self.scheds.get(p_key) if p_key is not None else None
        for ds in self.scheds.values():
            if ds.inst == e.get("inst"):
                ds.reads_seen = True
        pairs = self._pairs(ps, p_req, e.get("local_block_ids"), e.get("remote_block_ids"))
        self.counts["transfers"] += 1
        key = (e.get("pid"), rid)
        self.landed.pop(key, None)
        self.xfers[key] = {"read": e, "pairs": pairs, "p": ps.inst if ps else None, "p_lists": self._p_lists(ps, p_req),
                           "p_req": p_req, "landed": None, "ambiguous": ps is not None and ps.key[:2] in self.ambiguous}
        if len(self.xfers) > KEPT_P:  # (reads that never landed: the oldest go first)
            del self.xfers[next(iter(self.xfers))]

    def _p_req(self, ps: Any, p_req: Any) -> Any:
        """P's request on scheduler ``ps`` (still held, or lately freed), or None."""
        return (ps.reqs.get(str(p_req)) or self.gone.get((ps.inst, str(p_req)))) if ps is not None and p_req else None

    def _p_lists(self, ps: Any, p_req: Any) -> list | None:
        """P's request's block lists by token position (its scheduler's), as they are when D's read starts."""
        preq = self._p_req(ps, p_req)
        return [list(lst) for lst in preq.blocks] if preq is not None and preq.blocks else None

    def _pairs(self, ps: Any, p_req: Any, local: Any, remote: Any) -> list[tuple]:
        """(D block, P block, P's block as it is now, P's lists where the block is not the request's)."""
        # P's request's own lists (a block D reads outside them is not the request's, whatever it holds)
        preq = self._p_req(ps, p_req)
        mine = {b for lst in preq.blocks for b in lst} if preq is not None and preq.blocks else None
        pairs = []
        for lg, rg in zip(local or [], remote or []):
            for lb, rb in zip(lg, rg):
                pb = ps.blocks.get(rb) if ps is not None else None
                if mine is not None and rb not in mine:  # (never seen on P: nothing P wrote in the trace)
                    pairs.append((lb, rb, pb.snapshot() if pb is not None else Block(), preq.blocks))
                else:
                    pairs.append((lb, rb, pb.snapshot() if pb is not None else None, None))
        return pairs

    def _nixl_trim(self, e: Event) -> None:
        """Push mode (NixlPushConnector): P's worker paired D's blocks (``local_out``) with its own
        (``remote_out``) and WRITEs them into D; the write lands when D reports the request received
        (D's ``nixl.read_done`` for its own id, ``remote_req`` here). Pull-mode trims are D's reads' own."""
        if e.get("mode") != "push" or e.get("remote_req") is None:
            return
        p_req = str(e.get("req"))
        p_key = (self.p_of.get(p_req) or (None, None))[0]
        if p_key is None:
            r = self.req_of(e)
            p_key = r.sched if r is not None else None
        ps = self.scheds.get(p_key) if p_key is not None else None
        self.counts["transfers"] += 1
        self.pushes[str(e["remote_req"])] = {
            "read": e, "pairs": self._pairs(ps, p_req, e.get("local_out"), e.get("remote_out")),
            "p_lists": self._p_lists(ps, p_req),
            "p": ps.inst if ps else None, "p_req": p_req, "landed": None, "push": True,
            "ambiguous": ps is not None and ps.key[:2] in self.ambiguous}
        if len(self.pushes) > KEPT_P:  # (writes that never landed: the oldest go first)
            del self.pushes[next(iter(self.pushes))]
        done = self.early.pop(str(e["remote_req"]), None)
        if done is not None:  # (D said it landed first: the blocks take what P's trim says now)
            self._nixl_read_done(done)

    def _nixl_read_done(self, e: Event) -> None:
        key = (e.get("pid"), str(e.get("req")))
        x = self.xfers.pop(key, None) or self.landed.get(key) or self.pushes.pop(str(e.get("req")), None)
        if x is None:
            self._landed_first(e)
            return
        self.landed[key] = x  # (landed reads: a few are kept for a second record of the same landing)
        if len(self.landed) > KEPT_LANDED:
            del self.landed[next(iter(self.landed))]
        r = self.req_of(e)
        if r is None:
            return
        s = self.scheds[r.sched]
        if x.get("push"):
            s.reads_seen = True  # (D's KV came from P's write: its loads can be judged)
        ok = e.get("status") == "DONE"
        if x["landed"] is not None:
            if ok or x["landed"] != "DONE" or x["landed_step"] != e.get("step"):
                return  # (vLLM 0.32 puts a failed load in finished_recving too: DONE after ERR is no load)
        x["landed"], x["landed_step"] = e.get("status"), e.get("step")
        read = x["read"]
        how = PUSHED if x.get("push") else READ
        for lb, rb, p, not_its in x["pairs"]:
            blk = s.block(lb)
            src = Src(x["p"], x["p_req"], rb, read.get("id"), p, x.get("ambiguous", False), not_its)
            if not ok:
                self._set(blk, FAILED, 0, 0, f"{how} {e.get('status')}", e, src)
            elif p is None:
                self._set(blk, "unknown", 0, 0, "NIXL read from a P block not in the trace", e, src)
            else:
                self._set(blk, p.label, p.lo, p.hi, how, e, src)
            self._changed(s, lb, blk, None)

    def _landed_first(self, e: Event) -> None:
        """Push mode: D says P's write landed before P's trim is in the trace (merged hosts whose clocks order them
        the other way, or P's worker not recorded). What the blocks received is not known yet: reads of them are
        not judged (never a finding on a block whose write the trace does not show) until P's trim comes."""
        r = self.req_of(e)
        if r is None or e.get("status") != "DONE":
            return
        s = self.scheds.get(r.sched)
        if s is None or "Push" not in str(s.cfg.get("connector") or ""):
            return  # (pull mode: a completion without a read is a full local prefix hit, nothing read)
        self.early[str(e.get("req"))] = e
        if len(self.early) > KEPT_LANDED:
            del self.early[next(iter(self.early))]
        for lst in r.blocks:
            for b in lst:
                blk = s.blocks.get(b)
                if blk is not None and blk.label == PENDING:
                    self._set(blk, "unknown", 0, 0, "P's push write landed; its trim is not in the trace yet", e)

    def _read_own(self, src: Src) -> None:
        """A block D loaded from P's ``src.req`` read as D's own content (what the lease verdict asks)."""
        _remember(self.p_ok, str(src.req))

    def _never_read(self, src: Src) -> None:
        """D freed a block it loaded from P's ``src.req`` before any step attended to it."""
        _remember(self.p_unread, str(src.req))

    def lease_intact(self) -> list[str]:
        """P requests whose lease ran out and whose loaded blocks D read as its own (the KV intact)."""
        return sorted(p for p in self.expired if p in self.p_ok)

    def lease_unread(self) -> list[str]:
        """P requests whose lease ran out and whose loaded blocks D never attended to (freed first)."""
        return sorted(p for p in self.expired if p in self.p_unread and p not in self.p_ok)

    def _nixl_lease_expired(self, e: Event) -> None:
        self.expired[str(e.get("req"))] = e.get("id")
        if len(self.expired) > KEPT_P:
            del self.expired[next(iter(self.expired))]

    def _spec_window(self, e: Event) -> None:
        """The drafter writes KV at positions start..end of the request: each must fall in a block the
        request holds (past its list the slot mapping names a block table entry it does not own)."""
        r = self.req_of(e) or self.gone.get((e.get("inst"), str(e.get("req"))))
        if r is None or not r.blocks:
            return  # (no allocation: a V2 warm-up window, or the request's allocation is not in the trace)
        s = self.scheds.get(r.sched)
        if s is None:
            return
        self.counts["windows"] += 1
        g0 = e.get("group")
        end = int(e.get("end") or 0)
        for g, lst in enumerate(r.blocks):
            attn, bs = s.group(g)[:2]
            if (g0 is not None and g != g0) or not attn:
                continue
            cap = len(lst) * bs
            if end > cap:
                self.report("window", s, r, e=e, group=g, cap=cap)
                return

    # --- failed loads -----------------------------------------------------------------------
    def _kvload_handled(self, e: Event) -> None:
        bids = e.get("block_ids")
        if not bids or e.get("error"):
            return
        s = self.sched(e)
        for b in bids:
            blk = s.block(b)
            self._set(blk, FAILED, 0, 0, "reported failed to load (invalid_block_ids)", e)
            self._changed(s, b, blk, None)
        s.failed[e.get("step")] = (set(bids), e.get("id"))
        if len(s.failed) > 64:
            del s.failed[next(iter(s.failed))]

    def _kvload_request(self, e: Event) -> None:
        """Where the scheduler left a request after a failed load: what its next step starts from."""
        s = self.sched(e)
        r = s.reqs.get(str(e.get("req")))
        if r is not None and e.get("computed") is not None:
            r.computed = r.upto = int(e["computed"])

    def _kvload_output(self, e: Event) -> None:
        """A step in flight at a rollback, whose token was kept: it read the blocks as they were
        before the failure was known, which held the failed load."""
        if not e.get("in_flight") or int(e.get("appended") or 0) <= 0:
            return
        s = self.sched(e)
        r = s.reqs.get(str(e.get("req")))
        failed = s.failed.get(e.get("rollback_step"))
        if r is None or failed is None:
            return
        c = r.last.get(e.get("step"))
        held = [(g, b, i) for g, lst in enumerate(r.blocks) for i, b in enumerate(lst)
                if b in failed[0] and (c is None or i * block_size(s.cfg, g) < c)]
        if held:
            self.report("in-flight", s, r, e=e, held=held, handled=failed[1])


def _remember(table: dict, key: str) -> None:
    """``key`` in ``table`` (an ordered set), the oldest let go past KEPT_P."""
    if key not in table:
        table[key] = None
        if len(table) > KEPT_P:
            del table[next(iter(table))]
