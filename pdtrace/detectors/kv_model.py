"""One model of the KV cache (issue 59): shadow state per instance and block, as a sanitizer keeps.

Built once per trace from the recorded events, in trace order, streamed like every detector. For
each scheduler (instance) and block it knows:

- what the block holds: a *label* ``(prompt, group, index)``, the token-block ``index`` of the
  request whose prompt hash is ``prompt`` (``req.add``'s ``prompt_hash``: never the tokens), and the
  positions of that block written so far (``lo``..``hi``); or a state without content of a request:
  ``awaiting`` (handed to a request for a KV load that has not landed), ``failed`` (a load that
  failed), ``unwritten`` (handed to a request that has not written it);
- who wrote it: a step's forward (``sched.step``: a request's scheduled tokens at its positions, in
  every attention group), a completed NIXL read (D's block takes what P's block held when D issued
  the read), a prefix-cache hit (vLLM matched the block by hash: its label and the request's are one
  content from then on, a union), a failed load (``nixl.read_done`` ERR, ``kvload.handled``'s blocks);
- who holds it, when it was freed and who took it next.

Where a step reads KV (``reads``), every block of the positions it attends to (all earlier positions
for full attention, the window for sliding-window and chunked-local groups; state groups are not
token-indexed and are not modelled) must hold that request's label, written at those positions.
``kv_invariant`` turns what fails into findings. The model is fed events only; it judges nothing
itself and never reads another detector.

To stay linear in the trace a request is not re-checked block by block each step: a block is
*dirty* for a holder when it last changed to something other than the holder's own content, or
was handed to it without being written, and only dirty blocks are checked when the holder next
reads (a block written by the holder's own forward from its first position is clean).
"""

from __future__ import annotations

from typing import Any, Callable

from .index import is_attention_group, kind_code
from .kv_state import AWAITING, FAILED, PENDING, UNWRITTEN, Block, Req, Sched, block_size
from .kv_digests import Digests
from .kv_reads import Reads
from .request_ids import BaseIndex
from .kv_transfers import KEPT_P, Transfers

Event = dict[str, Any]
Report = Callable[..., None]
KEPT_SCHEDS = 64  # schedulers kept once replaced in their process (vLLM's own tests build hundreds)

KINDS = ("sched.config", "req.add", "sched.alloc", "sched.step", "sched.output", "sched.free", "nixl.request_finished",
         "nixl.remote_alloc", "nixl.read", "nixl.trim", "nixl.read_done", "nixl.lease_expired", "kvload.handled", "kvload.request",
         "kvload.output", "spec.window", "kv.digest", "kv.digest_setup")
KEPT_PENDING = 16  # steps whose output is awaited, per scheduler (async scheduling keeps one or two in flight)
__all__ = ["AWAITING", "FAILED", "PENDING", "UNWRITTEN", "KINDS", "Block", "Model", "Req", "Sched"]


class Model(Transfers, Reads, Digests):
    """The shadow KV cache. ``report(kind, sched, req, **facts)`` is called for each read that
    breaks the invariant (``kind``: "read"), for reads it cannot judge ("unjudged") and for a
    step in flight at a failed load whose token was kept ("in-flight")."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.configs: Any = None
        self.scheds: dict[tuple, Sched] = {}  # (pid, instance, its sched.config's id) -> its state
        self.current: dict[tuple, Sched] = {}  # (pid, instance) -> the scheduler its events are now of
        self.ambiguous: set[tuple] = set()  # (pid, instance) whose events may be of several schedulers
        self.by_engine: dict[str, tuple] = {}
        self.via: dict[Any, Sched] = {}  # instance -> the scheduler a worker's event last named a request of
        self.p_of: dict[str, tuple] = {}  # P's request id -> (its scheduler, its prompt) for D's reads
        self.p_ids = BaseIndex(KEPT_P)  # ... by base id (D may name P's request by the router's id)
        self.uf: dict[Any, Any] = {}  # label -> the label it was found to equal (prefix-cache hits)
        self.xfers: dict[tuple, dict] = {}  # (D pid, D request) -> the read in flight
        self.pushes: dict[str, dict] = {}  # D request -> P's write into its blocks in flight (push mode)
        self.early: dict[str, dict] = {}  # D request -> its completion, seen before P's push trim
        self.p_digests: dict[str, tuple] = {}  # P request -> ({block: (group, digest)}, event id) (--kv-checksum)
        self.d_waiting: dict[str, list] = {}  # P request -> D's digests waiting for P's
        self.digest_counts: dict[int, int] = {}  # group -> loaded blocks whose bytes were compared
        self.digest_reqs = 0  # D requests whose loaded bytes were compared
        self.digest_apart: set[str] = set()  # P/D pairs whose KV layouts differ: their digests are not compared
        self.digest_setup: dict[Any, dict] = {}  # instance -> its workers' kv.digest_setup (every N, skipped layers)
        self.mech_of: Any = lambda s, r: None  # the mechanism the invariant gave a request (kv_invariant sets it)
        self.landed: dict[tuple, dict] = {}  # ... and the last few that landed
        self.p_ok: dict[str, None] = {}  # P requests whose blocks D read and found its own (lately)
        self.p_unread: dict[str, None] = {}  # ... whose loaded blocks D freed before any step attended to them
        self.track = False  # the trace records sched.output: each step's writes are in flight until it
        self.expired: dict[str, int] = {}  # P's request id -> its nixl.lease_expired id
        self.counts = {"reads": 0, "transfers": 0, "unjudged": 0, "windows": 0, "edge": 0}
        self.gone: dict[tuple, Req] = {}  # (instance, request) -> a request freed lately (the drafter's
        # window is recorded by the worker, after the scheduler may have freed it)

    # --- labels ---------------------------------------------------------------------------
    def find(self, x: Any) -> Any:
        uf = self.uf
        while x in uf:
            nxt = uf[x]
            if nxt in uf:
                uf[x] = uf[nxt]
            x = nxt
        return x

    def same(self, a: Any, b: Any) -> bool:
        return a == b or (type(a) is tuple and type(b) is tuple and self.find(a) == self.find(b))

    # --- schedulers -------------------------------------------------------------------------
    def sched(self, e: Event) -> Sched:
        """The scheduler that emitted ``e``: the latest one its process built for that instance (vLLM's own
        tests build many in one process, reusing request and block ids: each is a KV cache of its own)."""
        where = (e.get("pid"), e.get("inst"))
        s = self.current.get(where)
        if s is None:
            cfg = (self.configs.config_of(e) if self.configs is not None else None) or {}
            s = self._new(where, cfg)
        return s

    def _new(self, where: tuple, cfg: dict) -> Sched:
        old = self.current.get(where)
        if old is not None and not old.used:
            # two schedulers of one instance built in one process before either ran a request (a test harness's
            # P/D pairs): its scheduler events do not name their scheduler, so which one emitted them is not known
            self.ambiguous.add(where)
        key = (*where, cfg.get("id"))
        self.via.clear()
        s = self.scheds[key] = self.current[where] = Sched(key, str(where[1] or ""), cfg)
        if len(self.scheds) > KEPT_SCHEDS:  # (schedulers replaced long ago: the oldest go first)
            live = set(map(id, self.current.values()))
            for k in [k for k, v in self.scheds.items() if id(v) not in live][:len(self.scheds) - KEPT_SCHEDS]:
                del self.scheds[k]
        if cfg.get("engine"):
            self.by_engine[str(cfg["engine"])] = key  # (the latest scheduler of that engine id)
        return s

    def _sched_config(self, e: Event) -> None:
        self._new((e.get("pid"), e.get("inst")), e)

    def req_of(self, e: Event) -> Req | None:
        """The request an event names, on its own scheduler or (a worker's event) on the latest
        scheduler of its instance that holds a request of that id."""
        s = self.current.get((e.get("pid"), e.get("inst")))
        r = s.reqs.get(str(e.get("req"))) if s is not None else None
        if r is not None:
            return r
        rid, inst = str(e.get("req")), e.get("inst")
        s = self.via.get(inst)  # (the scheduler a worker's last event was found on)
        if s is not None and rid in s.reqs:
            return s.reqs[rid]
        for s in reversed(list(self.current.values())):
            if s.inst == inst and rid in s.reqs:
                self.via[inst] = s
                return s.reqs[rid]
        return None

    # --- feeding ------------------------------------------------------------------------------
    def feed(self, idx: Any) -> None:
        self.configs = idx.configs
        if not self.track and idx.by_kind.get("sched.output"):
            self.track = True
        codes = {kind_code(k): getattr(self, "_" + k.replace(".", "_")) for k in KINDS}
        for e, k in zip(*idx.ordered_codes(KINDS)):
            codes[k](e)

    def _req_add(self, e: Event) -> None:
        s = self.sched(e)
        rid = str(e.get("req"))
        s.used = True
        r = s.reqs[rid] = Req(rid, s.key, e.get("prompt_hash"), int(e.get("prompt_len") or 0))
        self.via.clear()  # (a newer scheduler may hold that id now)
        r.ids["add"] = e.get("id")
        kv = e.get("kv") or {}
        r.remote = (kv.get("remote_request_id"), kv.get("remote_engine_id"))
        if kv.get("do_remote_decode"):
            self._p_request(rid, s.key, r.key)

    def _p_request(self, rid: str, key: tuple, prompt: Any) -> None:
        self.p_of[rid] = (key, prompt if prompt is not None else (self.p_of.get(rid) or (None, None))[1])
        self.p_ids.add(rid)
        if len(self.p_of) > KEPT_P:
            del self.p_of[next(iter(self.p_of))]

    def _nixl_request_finished(self, e: Event) -> None:
        if e.get("side") == "P":
            s = self.sched(e)
            r = s.reqs.get(str(e.get("req")))
            self._p_request(str(e.get("req")), s.key, r.key if r is not None else None)
            if e.get("engine"):
                self.by_engine.setdefault(str(e["engine"]), s.key)

    def _sched_alloc(self, e: Event) -> None:
        if e.get("ok") is False:
            return
        s = self.sched(e)
        rid = str(e.get("req"))
        r = s.reqs.get(rid)
        if r is None:  # no req.add (a ring trace's cut beginning): no prompt to compare with
            r = s.reqs[rid] = Req(rid, s.key, None, int(e.get("prompt_len") or 0))
            self.via.clear()
        r.ids.setdefault("alloc", e.get("id"))
        new = e.get("block_ids")
        if new is None:
            new = [list(a) + list(b) for a, b in zip(r.blocks, e.get("new_block_ids") or [])]
        c = e.get("num_computed_tokens")
        first = "num_external_computed_tokens" in e and "block_ids" in e and not e.get("from_output")
        old = r.blocks
        if new != old:  # (a running request's step that needed no new block: nothing changes hands)
            self._hold(s, r, new, e)
        if c is not None:
            r.computed = r.upto = int(c)
        if first and (e.get("num_new_computed_tokens") or e.get("num_external_computed_tokens")):
            self._admit(s, r, e, old)

    def _hold(self, s: Sched, r: Req, new: list[list[int]], e: Event) -> None:
        """``r`` holds the lists ``new`` from now on: blocks it no longer lists lose it as a
        holder, blocks it gains are handed to it (dirty unless they already hold its content)."""
        ev = e.get("id")
        uf, holders, rid, key = self.uf, s.holders, r.req, r.key
        for g, lst in enumerate(new):
            prev = r.blocks[g] if g < len(r.blocks) else []
            n = len(prev)
            if len(lst) >= n and lst[:n] == prev:  # (a running request's list grows at its end)
                if len(lst) == n:
                    continue
                start = n
            else:
                start = 0
                for b in set(prev) - set(lst):
                    h = s.holders.get(b)
                    if h is not None:
                        h.pop(r.req, None)
                    r.dirty.pop((g, b), None)
            attn, bs = s.group(g)[:2]
            for i in range(start, len(lst)):
                b = lst[i]
                if b == 0 or (i < n and prev[i] == b):
                    continue
                h = holders.get(b)
                if h is None:
                    holders[b] = {rid: (g, i)}
                else:
                    h[rid] = (g, i)
                blk = s.block(b)
                if blk.owner != rid:
                    blk.owner, blk.own_ev = rid, ev
                if attn:
                    lab = blk.label
                    if not ((lab == (key, g, i) or (uf and self.same(lab, (key, g, i)))) and blk.lo == 0
                            and blk.hi >= bs):
                        r.dirty[(g, b)] = i
        r.blocks = new  # (the event's own lists: nothing changes them)

    def _admit(self, s: Sched, r: Req, e: Event, old: list) -> None:
        """A request's first allocation: its prefix-cache hit (the blocks vLLM matched by hash hold
        its content: one label from now on) and the blocks it waits to load from P."""
        hit = int(e.get("num_new_computed_tokens") or 0)
        ext = int(e.get("num_external_computed_tokens") or 0)
        if hit + ext == 0:
            return  # (no hit, nothing to load: every allocation of a running request carries these fields)
        if hit + ext > int(e.get("num_computed_tokens") or 0):
            # what the request starts from once its load lands (vLLM recomputes a prompt's last token when
            # everything is loaded: num_computed_tokens set again after the load, not recorded)
            r.computed = min(hit + ext, max(r.plen - 1, 0)) if r.plen else hit + ext
            r.upto = hit + ext
        kinds = s.cfg.get("group_kinds") or []
        hazards: list[tuple] = []
        readers: list[tuple] = []
        # the tokens it loads are P's prompt's: a proxy may hand D P's prompt plus P's first token (vLLM PR
        # #50559), so D's prompt hash is not P's; the loaded token blocks are P's request's content all the same
        pk = (self.p_of.get(self.p_ids.match(str(r.remote[0]), self.p_of) or "") or (None, None))[1] \
            if ext and r.remote[0] else None
        for g, lst in enumerate(r.blocks):
            if not is_attention_group(kinds[g] if g < len(kinds) else None):
                continue
            bs = block_size(s.cfg, g)
            if pk is not None and r.key is not None and pk != r.key:
                for i in range(min(-(-(hit + ext) // bs), len(lst))):
                    if (r.key, g, i) not in self.uf and self.find((pk, g, i)) != (r.key, g, i):
                        self.uf[(r.key, g, i)] = self.find((pk, g, i))
                        r.unions.append((r.key, g, i))
            for i in range(min(-(-(hit + ext) // bs), len(lst))):
                b = lst[i]
                if b == 0:
                    continue
                blk = s.blocks[b]
                if (i + 1) * bs <= hit:
                    lab = blk.label
                    if type(lab) is tuple and lab[1:] == (g, i) and r.key is not None and blk.lo == 0:
                        a, root = self.find((r.key, g, i)), self.find(lab)
                        if a != root:
                            self.uf[a] = root  # vLLM matched it by hash: one content from now on
                elif ext and i * bs >= hit - hit % bs:
                    self._set(blk, AWAITING, 0, 0, "allocated for a KV load", e)
                    r.dirty[(g, b)] = i
                    loaded = min(bs, hit + ext - i * bs)
                    stale = [x for x in s.inflight.get(b, ()) if x[1] != r.req and x[2] < loaded]
                    if stale:  # a step in flight still writes another request's KV where the load will land
                        hazards.append((g, i, b, loaded, stale, blk.freed))
                    if s.reading:
                        readers.extend(self._read_in_flight(s, r, g, i, b, loaded))
        if hazards:
            self.report("in-flight-write", s, r, e=e, hazards=hazards)
        for r0, hz in readers:
            self.report("in-flight-read", s, r0, e=e, loader=r.req, hazards=hz)

    def _read_in_flight(self, s: Sched, r: Req, g: int, i: int, b: int, loaded: int) -> list:
        """Block ``b`` is handed to ``r``'s load while the model still has another running request holding it in a
        window group: vLLM pruned it from that request (out of the window by the count it pruned with). Each step of
        that request whose output is not processed yet and whose window still reads offsets the load fills: the
        NIXL read lands under that step's attention (vLLM #47282)."""
        out = []
        for rid0, (g0, i0) in list((s.holders.get(b) or {}).items()):
            r0 = s.reqs.get(rid0)
            if rid0 == r.req or g0 != g or r0 is None:
                continue
            _attn, bs, win, kind = s.group(g)
            if not win:
                continue  # (a full-attention block leaves a running request only with the request: a free)
            hz = []
            for st, per in s.reading.items():
                c0, sev = per.get(rid0) or (None, None)
                if c0 is None:
                    continue
                start = c0 - c0 % win if "Chunked" in kind else max(0, c0 - win + 1)
                lo = max(start - i0 * bs, 0)
                if i0 * bs <= c0 and (i0 + 1) * bs > start and loaded > lo:
                    hz.append((g, i0, b, st, lo, min(bs, c0 + 1 - i0 * bs), i, loaded, sev))
            if hz:
                out.append((r0, hz))
        return out

    def _set(self, blk: Block, label: Any, lo: int, hi: int, how: str, e: Event, src: dict | None = None) -> None:
        blk.under = None
        blk.label, blk.lo, blk.hi, blk.how, blk.src = label, lo, hi, how, src
        blk.ev, blk.step, blk.w = e.get("id"), e.get("step"), e.get("w")

    def _changed(self, s: Sched, b: int, blk: Block, writer: str | None) -> None:
        """Block ``b`` took new content: it is dirty for each holder whose content it is not."""
        for rid, (g, i) in (s.holders.get(b) or {}).items():
            r = s.reqs.get(rid)
            if r is not None and (rid != writer or blk.lo > 0 or not self.same(blk.label, (r.key, g, i))):
                r.dirty[(g, b)] = i

    def _sched_step(self, e: Event) -> None:
        s = self.sched(e)
        tokens = e.get("tokens") or {}
        spec = e.get("spec") or {}
        step, ev, w = e.get("step"), e.get("id"), e.get("w")
        plan = []
        group, blocks = s.group, s.blocks
        track = self.track
        if track:
            written = s.pending[step] = []
            reading = s.reading[step] = {}
            if len(s.pending) > KEPT_PENDING:  # (outputs not recorded for those: forget them)
                self._processed(s, next(iter(s.pending)))
        for rid, n in tokens.items():
            r = s.reqs.get(rid)
            if r is None or r.computed is None:
                continue
            c, n = r.computed, int(n)
            # the forward writes every scheduled position, drafts included; where the step's own allocation
            # was not recorded, the previous step's drafts may have been accepted: up to ``upto``
            w0, w1 = min(c, r.upto), max(c, r.upto) + n
            plan.append((r, c, n))
            if track:
                reading[rid] = (w1 - n, ev)
            for g, lst in enumerate(r.blocks):  # ... in every attention group
                attn, bs = group(g)[:2]
                if not attn:
                    continue
                for i in range(max(w0 // bs, 0), min((w1 - 1) // bs + 1 if w1 > w0 else w0 // bs, len(lst))):
                    b = lst[i]
                    if b == 0:
                        continue
                    label, lo, hi = (r.key, g, i), max(w0 - i * bs, 0), min(w1 - i * bs, bs)
                    if track:
                        s.inflight.setdefault(b, []).append((step, r.req, lo, hi, ev, i))
                        written.append(b)
                    blk = blocks.get(b)
                    if blk is not None and blk.label == label and blk.lo <= lo <= blk.hi:  # (its own next positions)
                        if hi > blk.hi:
                            blk.hi = hi
                        blk.ev, blk.step, blk.w = ev, step, w
                        if blk.lo == 0 and r.dirty:
                            r.dirty.pop((g, b), None)
                        continue
                    self._write(s, b, label, lo, hi, r, e)
        for r, c, n in plan:  # then each step reads what its attention covers (written layer by layer first)
            self.reads(s, r, c, e)
            r.last[step] = c
            if len(r.last) > 4:
                del r.last[next(iter(r.last))]
            d = int(spec.get(r.req) or 0)
            r.computed, r.upto = c + n - d, max(c, r.upto) + n  # (no draft accepted .. all) until its next allocation

    def _sched_output(self, e: Event) -> None:
        """Step ``e.step``'s output was processed: its forward's writes are done."""
        s = self.sched(e)
        step = e.get("step")
        for st in [k for k in s.pending if k is not None and step is not None and k <= step]:
            self._processed(s, st)

    def _processed(self, s: Sched, st: Any) -> None:
        s.reading.pop(st, None)
        for b in s.pending.pop(st, ()):
            lst = s.inflight.get(b)
            if lst is not None:
                lst[:] = [x for x in lst if x[0] != st]
                if not lst:
                    del s.inflight[b]

    def _write(self, s: Sched, b: int, label: tuple, lo: int, hi: int, r: Req, e: Event) -> None:
        blk = s.block(b)
        lab = blk.label
        if (lab == label or (self.uf and self.same(lab, label))) and blk.lo <= lo <= blk.hi:
            blk.hi = max(blk.hi, hi)
            blk.ev, blk.step, blk.w = e.get("id"), e.get("step"), e.get("w")
            if blk.lo == 0:
                r.dirty.pop((label[1], b), None)
            return
        under = (blk.label, blk.how, blk.ev, blk.src, blk.lo, blk.hi) if lo > 0 else None
        self._set(blk, label, lo, hi, "forward", e)
        blk.under = under
        self._changed(s, b, blk, r.req)

    def _sched_free(self, e: Event) -> None:
        s = self.sched(e)
        rid = str(e.get("req"))
        r = s.reqs.pop(rid, None)
        ev = e.get("id")
        if r is not None:
            for (_g, b) in r.dirty:  # loaded blocks it never attended to: nothing was decoded on them
                blk = s.blocks.get(b)
                if blk is not None and blk.src is not None:
                    self._never_read(blk.src)
            for lab in r.unions:  # (a later request of the same prompt makes its own)
                self.uf.pop(lab, None)
            r.unions = []
            self.gone[(s.inst, rid)] = r
            if len(self.gone) > 4096:
                del self.gone[next(iter(self.gone))]
        freed = (rid, ev, e.get("w"))
        for lst in (e.get("block_ids") or (r.blocks if r else [])):
            for b in lst:
                if b == 0:
                    continue
                h = s.holders.get(b)
                if h is not None:
                    h.pop(rid, None)
                    if not h:
                        del s.holders[b]
                blk = s.blocks.get(b)
                if blk is not None:
                    blk.freed = freed
