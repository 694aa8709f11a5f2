"""P->D KV transfers joined from the trace: one ``Transfer`` per D allocation (or P report).

Every event belongs to its own scheduler: a process (``pid``), an instance (``inst``), and
where the hooks record it, a scheduler ordinal in that process (``sched``) and a KV-transfer
engine id (``engine``). P's ``nixl.request_finished`` and D's ``nixl.remote_alloc`` are
paired when

- D's ``remote_req`` (P's request id as D received it; D's own id in older traces) is P's
  ``req``,
- P's ``engine`` is D's ``remote_engine`` when both are recorded, and
- P finished before D allocated (trace order; ``pdtrace merge`` aligns clocks on exactly
  this causality). Of several such P reports (a retried or reused request id) the latest
  one not already taken is used. A P report that comes after D's allocation while it is
  still open (the two clocks a few ms apart) is bound to it then (``Joiner._bind_late``).

So two schedulers of one process that reuse ``id-1`` never cross-join, and a D allocation
whose P side is not in the trace stays D-only. D's trims / reads are those of the same
instance and request after the allocation and before that request's next allocation. Block
sizes and group kinds come from the scheduler that emitted the event (``sched.config`` of
the same pid and ``sched``; else the latest of the same pid and instance; else the
instance's first), not from the first ``sched.config`` of the trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .index import Index, build, is_attention_group, kind_code
from .request_ids import BaseIndex, base_id
from .transfer_lists import (NULL_BLOCK, _TAIL_MARKERS, _kv_group, _pairs_from_reads, blocks_needed,  # noqa: F401
                             end_trim, group_block_size, group_kind, is_tail_group, load_list)

Event = dict[str, Any]
_INF = float("inf")
# how much later than D's allocation P's report may be stamped and still be the one it pulled: two processes'
# wall clocks, each read with the monotonic clock once at start, differ by a few ms on a loaded host
LATE_REPORT_NS = 50_000_000



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
    remote_num_tokens: int | None  # None: nothing in the trace says it (see tokens_source)
    reported: list[list[int]]  # P's remote_block_ids per group
    local: list[list[int]] | None  # D's local blocks to load, per group (None: no D side)
    mapping: list[list[tuple[int, int]]] | None  # recorded (local, remote) pairs per group
    mapping_source: str  # nixl.read | nixl.trim | inferred | none
    tokens_source: str = ""  # where remote_num_tokens came from
    # each block D loads into, its token-block index in D's whole list for the request (the
    # hook records that list in nixl.remote_alloc), per group; None without D's trim to say
    # which blocks it loads into
    d_positions: list[dict[int, int] | None] | None = None
    raised: str = ""  # D's trim raised (nixl.trim.raised), e.g. more blocks to load than P reported
    # per group, whether ``local`` is exactly what D's connector loads into (None: D's trim says so;
    # False: derived from D's whole list where the trace does not say how the connector cut it)
    local_exact: list[bool] | None = None

    def local_known(self, g: int) -> bool:
        return self.local_exact is None or (g < len(self.local_exact) and self.local_exact[g])

    @property
    def req(self) -> str | None:
        return self.p_req or self.d_req

    def block_size(self, g: int) -> int:
        return group_block_size(self.config, g)

    def group_kind(self, g: int) -> str:
        return group_kind(self.config, g)

    def is_attention(self, g: int) -> bool:
        return is_attention_group(self.group_kind(g))

    def event_ids(self) -> list[int]:
        evs = [self.p_finished, self.config, self.d_alloc, self.trim, *self.reads]
        return sorted({e["id"] for e in evs if e is not None and "id" in e})


def join_transfers(events: list[Event], idx: Index | None = None) -> list[Transfer]:
    """Pair P's reports with D's allocations / trims / reads (see the module docstring):
    P reports in trace order (each with the D allocation that pulled it, or none), then D
    allocations whose P side is not in the trace."""
    idx = idx or build(events)
    out: list[tuple] = []
    j = Joiner(lambda p, a, ctx: out.append((p, a, ctx)))
    j.feed(idx)
    j.finish()
    out.sort(key=lambda x: (0, _pos(x[0])) if x[0] is not None else (1, _pos(x[1])))
    return [_make(idx, p, a, *ctx) for p, a, ctx in out]


class _Open:
    """A D allocation whose window is open: the trims and reads that follow it so far."""

    __slots__ = ("a", "p", "key", "rkey", "trims", "pushed", "reads", "reads_p")

    def __init__(self, a: Event, p: Event | None, key: tuple, rkey: Any):
        self.a, self.p, self.key, self.rkey = a, p, key, rkey
        self.trims: list[Event] = []
        self.pushed: list[Event] = []  # push mode: P's trims naming this D request
        self.reads: list[Event] = []  # keyed by D's request id
        self.reads_p: list[Event] = []  # keyed by P's request id only


class Joiner:
    """Transfers paired as the events are fed in trace order (``feed`` one ``Index`` of
    consecutive events at a time, then ``finish``); ``emit(p, a, ctx)`` is called once per
    transfer when it is complete, with ``ctx`` = (D's last trim, D's reads, unkeyed trims).

    A D allocation's window (the trims and reads that belong to it) runs until the next
    allocation of the same instance and request, or until that request ends on that instance
    (``req.finish`` / ``sched.free``), or the end of the trace. A P report waits until a D
    allocation pulls it, and is let go when that transfer completes; the reports nobody
    pulled are emitted P-only at ``finish``. So the state is the open transfers and the
    reports not yet pulled, not the trace."""

    KINDS = ("nixl.request_finished", "nixl.remote_alloc", "nixl.trim", "nixl.read", "req.finish", "sched.free")

    def __init__(self, emit: Any):
        self.emit = emit
        self.p_by_req: dict[Any, list[Event]] = {}  # P's reports not let go, per request id
        self.taken: set[int] = set()
        self.pulls: dict[int, int] = {}  # id of a taken report -> open transfers that pulled it
        self.open: dict[tuple, _Open] = {}  # (inst, D req) -> its open allocation
        self.by_p_id: dict[tuple, list[_Open]] = {}  # (inst, P req) -> open allocations pulling it
        self.by_d_req: dict[Any, list[_Open]] = {}  # D req -> open allocations (push-mode trims)
        self.unkeyed: list[Event] = []  # trims without a request (older traces)
        self.unbound: dict[Any, list[_Open]] = {}  # P req -> open allocations that found no P report yet
        self.configs: Any = None  # the scheduler configs read so far (``index.Configs``)
        self.p_ids, self.d_ids = BaseIndex(), BaseIndex()  # (ids paired as vLLM pairs them: request_ids)

    def feed(self, idx: Any) -> None:
        self.configs = idx.configs  # (not the Index: the segment is let go after the feed)
        if not any(idx.kind(k) for k in self.KINDS[:4]) and not self.open:
            return
        FIN, ALLOC, TRIM, READ, END, FREE = (kind_code(k) for k in self.KINDS)
        for e, k in zip(*idx.ordered_codes(self.KINDS)):
            if k == FIN:
                if e.get("side", "P") == "P":
                    self.p_by_req.setdefault(e.get("req"), []).append(e)
                    self.p_ids.add(e.get("req"))
                    if self.unbound:
                        self._bind_late(e)
            elif k == ALLOC:
                self._alloc(e)
            elif k == TRIM:
                if e.get("mode") == "push" and e.get("remote_req") is not None:
                    for op in self.by_d_req.get(self.d_ids.match(e["remote_req"], self.by_d_req), ()):
                        op.pushed.append(e)
                elif e.get("req") is not None:
                    op = self.open.get((e.get("inst"), e["req"]))
                    if op is not None:
                        op.trims.append(e)
                else:
                    self.unkeyed.append(e)
            elif k == READ:
                rk = e.get("req") or e.get("remote_req")
                if rk is None:
                    continue
                key = (e.get("inst"), rk)
                op = self.open.get(key)
                if op is not None:
                    op.reads.append(e)
                if e.get("remote_req") == rk:
                    for op in self.by_p_id.get(key, ()):
                        op.reads_p.append(e)
            else:  # the request ended on this instance
                op = self.open.get((e.get("inst"), e.get("req")))
                if op is not None:
                    self._close(op)

    def _alloc(self, a: Event) -> None:
        key = (a.get("inst"), a.get("req"))
        old = self.open.get(key)
        if old is not None:
            self._close(old)
        rkey = a.get("remote_req") or a.get("req")
        rkey = self.p_ids.match(rkey, self.p_by_req) or rkey  # (P's own id where D names the router's)
        p = _match(self.p_by_req.get(rkey), a, self.taken)
        if p is not None:
            self.taken.add(id(p))
            self.pulls[id(p)] = self.pulls.get(id(p), 0) + 1
        op = self.open[key] = _Open(a, p, key, rkey)
        if rkey is not None and rkey != key[1]:
            self.by_p_id.setdefault((key[0], rkey), []).append(op)
        if p is None and rkey is not None:
            self.unbound.setdefault(rkey, []).append(op)
        self.by_d_req.setdefault(key[1], []).append(op)
        self.d_ids.add(key[1])

    def _bind_late(self, p: Event) -> None:
        """P's report after the D allocation that pulled it: in a merged trace the two instances' clocks can be a
        few ms apart (a live run on one host put 3 of 10 P reports 4 ms after D's allocation), so the report
        is bound to the oldest open allocation of its request id (the engine too where both say) that found
        none, if stamped at most LATE_REPORT_NS after it. Only while that allocation is open: a report after
        D's request ended stays P-only."""
        req = p.get("req")
        if req not in self.unbound:  # (D named it by the router's id: P's id without its suffix)
            req = base_id(req)
        ops = self.unbound.get(req)
        eng = p.get("engine")
        for op in ops or ():
            want = op.a.get("remote_engine")
            if want is not None and eng is not None and want != eng:
                continue
            if p.get("w", 0) - op.a.get("w", 0) > LATE_REPORT_NS:  # not a clock's few ms: another round's report
                continue
            op.p = p
            self.taken.add(id(p))
            self.pulls[id(p)] = self.pulls.get(id(p), 0) + 1
            ops.remove(op)
            if not ops:
                del self.unbound[req]
            return

    def _close(self, op: _Open) -> None:
        del self.open[op.key]
        a, key, rkey = op.a, op.key, op.rkey
        waiting = self.unbound.get(rkey)
        if waiting is not None and op in waiting:
            waiting.remove(op)
            if not waiting:
                del self.unbound[rkey]
        for table, k in ((self.by_p_id, (key[0], rkey)), (self.by_d_req, key[1])):
            lst = table.get(k)
            if lst is not None and op in lst:
                lst.remove(op)
                if not lst:
                    del table[k]
        rd = op.reads or (op.reads_p if rkey is not None and rkey != key[1] else [])
        want_eng, want_req = a.get("remote_engine"), rkey
        rd = [r for r in rd if (r.get("remote_engine") in (None, want_eng) or want_eng is None)
              and (r.get("remote_req") is None or r.get("remote_req") in (want_req, a.get("req"))
                   or base_id(r.get("remote_req")) == base_id(want_req))]
        tr = op.trims or op.pushed
        if op.p is not None:  # the report is let go with the last open transfer that pulled it
            pid = id(op.p)
            self.pulls[pid] -= 1
            if not self.pulls[pid]:
                del self.pulls[pid]
                self.taken.discard(pid)
                lst = self.p_by_req.get(rkey, [])
                for i, x in enumerate(lst):
                    if x is op.p:
                        del lst[i]
                        break
                if not lst:
                    self.p_by_req.pop(rkey, None)
        self.emit(op.p, a, (tr[-1] if tr else None, rd, self.unkeyed))

    def finish(self) -> None:
        for op in list(self.open.values()):
            self._close(op)
        none_ctx: tuple = (None, [], self.unkeyed)
        left = [p for lst in self.p_by_req.values() for p in lst if id(p) not in self.taken]
        left.sort(key=_pos)
        for p in left:
            self.emit(p, None, none_ctx)
        self.p_by_req = {}


def _pos(e: Event) -> Any:
    """Trace order of an event: its id (loaded / merged traces), else its time."""
    i = e.get("id")
    return i if i is not None else e["t"]


def _match(cands: list[Event] | None, a: Event, taken: set[int]) -> Event | None:
    """The P report D's allocation ``a`` pulled: same request id (the caller's key), same
    engine where both say, finished before ``a``; the latest one not taken yet."""
    if not cands:
        return None
    at = _pos(a)
    want = a.get("remote_engine")
    best = fallback = None
    for p in cands:  # trace order; usually one
        if _pos(p) >= at:
            break
        eng = p.get("engine")
        if want is not None and eng is not None and eng != want:
            continue
        fallback = p
        if id(p) not in taken:
            best = p
    return best if best is not None else fallback


def _window(by_key: dict[tuple, list[Event]], key: tuple, lo: Any, hi: Any) -> list[Event]:
    evs = by_key.get(key)
    if not evs:
        return []
    if len(evs) == 1:
        p = _pos(evs[0])
        return evs if lo < p < hi else []
    return [e for e in evs if lo < _pos(e) < hi]


def _same(groups: Any) -> Any:
    return groups


def _copied(groups: Any) -> list[list[int]]:
    return [list(g) for g in groups]


def _tokens(idx: Index, p: Event | None, a: Event | None) -> tuple[int | None, str]:
    """How many tokens P computed for the transfer, and which field says so. A field the
    trace lacks is unknown, never 0: D's remote_num_tokens, then P's report, then D's
    num_external_tokens (tokens D loads: all of P's when D has no local prefix hit)."""
    if p is not None and p.get("remote_num_tokens") is not None:
        return int(p["remote_num_tokens"]), "P nixl.request_finished.remote_num_tokens"
    if a is not None and a.get("remote_num_tokens") is not None:
        return int(a["remote_num_tokens"]), "D nixl.remote_alloc.remote_num_tokens"
    if p is not None and p.get("num_computed_tokens") is not None:
        return int(p["num_computed_tokens"]), "P nixl.request_finished.num_computed_tokens"
    if a is not None and a.get("num_external_tokens"):
        local = a.get("local_block_ids") or []
        remote = a.get("remote_block_ids") or []
        # D loads everything P computed only when it allocated a block for every remote one
        if local and all(len(lo) == len(ro) for lo, ro in zip(local, remote)):
            return int(a["num_external_tokens"]), "D nixl.remote_alloc.num_external_tokens (no local prefix hit)"
    return None, ""


def _make(idx: Index, p: Event | None, a: Event | None, trim: Event | None, rd: list[Event],
          unkeyed_trims: list[Event], copy: bool = True) -> Transfer:
    """The ``Transfer`` of one pair. ``copy=False`` (a first look by ``detect``) leaves the
    per-group block lists as the events hold them instead of copying them."""
    lists = _copied if copy else _same
    d_req = a.get("req") if a is not None else None
    p_req = p.get("req") if p is not None else (a.get("remote_req") if a is not None else None)
    config = idx.config_of(p) if p is not None else None
    if config is None and a is not None:
        config = idx.config_of(a)
    reported = lists(p["block_ids"] if p is not None else a["remote_block_ids"])  # type: ignore[index]
    rnt, source = _tokens(idx, p, a)
    local = None
    mapping = None
    msource = "none"
    local_exact = None
    if a is not None:
        local, local_exact = load_list(a, config)
        if trim is None:
            for t in unkeyed_trims:
                if t["local_in"] in (a["local_block_ids"], local) and t["remote_in"] == a["remote_block_ids"]:
                    trim = t
        if trim is not None:
            local, local_exact = lists(trim["local_in"]), None
        if rd:
            mapping = _pairs_from_reads(rd, len(reported))
            msource = "nixl.read"
        elif trim is not None:
            mapping = [list(zip(lo, ro)) for lo, ro in zip(trim["local_out"], trim["remote_out"])]
            mapping += [[] for _ in range(len(local) - len(mapping))]  # (a trim that raised paired nothing)
            msource = "nixl.trim"
        else:
            remote_in = lists(a["remote_block_ids"])
            mapping = []
            for g, lo in enumerate(local):
                ro = remote_in[g] if g < len(remote_in) else []
                mapping.append(end_trim(lo, ro) if is_attention_group(group_kind(config, g)) else list(zip(lo, ro)))
            msource = "inferred"
    return Transfer(p_req, d_req, p, a, trim, list(rd), config, rnt, reported, local, mapping, msource, source,
                    _positions(a, trim), (trim or {}).get("raised") or "", local_exact)


def _positions(a: Event | None, trim: Event | None) -> list[dict[int, int] | None] | None:
    """Where the blocks of D's trim sit in D's whole list (nixl.remote_alloc.local_block_ids),
    per group: vLLM's own block list, not the count rule the trim applies. A group's entry is
    None unless its blocks are that list's unhashed suffix (every one in it, consecutive, to its
    end): kernel block ids, when a logical block spans several, are not positions there."""
    if a is None or trim is None or trim.get("mode") == "push":
        return None
    full = a.get("local_block_ids") or []
    out: list[dict[int, int] | None] = []
    for g, lo in enumerate(trim.get("local_in") or []):
        where = {b: i for i, b in enumerate(full[g])} if g < len(full) else {}
        pos = [where.get(b) for b in lo]
        suffix = bool(lo) and None not in pos and pos == list(range(len(full[g]) - len(lo), len(full[g])))
        out.append({b: where[b] for b in lo} if suffix else None)
    return out


__all__ = ["NULL_BLOCK", "Transfer", "blocks_needed", "end_trim", "group_block_size", "group_kind", "is_tail_group",
           "join_transfers", "load_list"]
