"""The KV model's state (``kv_model``): what one block holds, one request on one scheduler, one scheduler."""

from __future__ import annotations

from typing import Any

from .index import is_attention_group

AWAITING, PENDING, FAILED, UNWRITTEN = "awaiting", "pending", "failed", "unwritten"


def block_size(cfg: dict, g: int) -> int:
    """Group ``g``'s block size from a scheduler config (the first group's where the config lists fewer; at least 1:
    a damaged config must not divide by zero)."""
    bss = cfg.get("block_sizes") or [16]
    v = bss[g] if g < len(bss) else bss[0]
    return v if type(v) is int and v > 0 else 1


class Block:
    """What one block holds and how it came to. ``label``: (prompt, group, index) or a state string;
    ``lo``/``hi``: the positions of the block written with that label (offsets in the block)."""

    __slots__ = ("label", "lo", "hi", "how", "ev", "step", "w", "owner", "own_ev", "freed", "src", "under")

    def __init__(self) -> None:
        self.label: Any = UNWRITTEN
        self.lo = self.hi = 0
        self.how = ""  # forward | transfer | hit | failed load | allocated | ...
        self.ev: int | None = None  # the event that wrote it
        self.step: int | None = None
        self.w: int | None = None  # the write's wall time (ns)
        self.owner: str | None = None  # the request it was last handed to
        self.own_ev: int | None = None
        self.freed: tuple | None = None  # (request, event id) of the last free
        self.src: Src | None = None  # a transfer's source: P's instance, request, block and its state
        self.under: tuple | None = None  # what a write that began mid-block left below it (label, how, ev, src)

    def snapshot(self) -> Block:
        """A copy of what it is now (P's block as D's read found it)."""
        c = Block.__new__(Block)
        c.label, c.lo, c.hi, c.how, c.ev, c.step, c.w = self.label, self.lo, self.hi, self.how, self.ev, self.step, self.w
        c.owner, c.own_ev, c.freed, c.src, c.under = self.owner, self.own_ev, self.freed, self.src, self.under
        return c


class Src:
    """Where a NIXL read's block came from: P's instance, request, block, D's read event, P's block
    as it was when D issued the read (a ``Block`` snapshot; None: not in the trace)."""

    __slots__ = ("inst", "req", "block", "read", "p", "ambiguous", "not_its")

    def __init__(self, inst: str | None, req: Any, block: int, read: Any, p: Block | None, ambiguous: bool,
                 not_its: list | None = None) -> None:
        self.inst, self.req, self.block, self.read, self.p, self.ambiguous = inst, req, block, read, p, ambiguous
        self.not_its = not_its  # P's request's own lists, where ``block`` is not among them


class Req:
    """A request on one scheduler: its prompt, its blocks per group, its computed tokens, the blocks
    to check at its next read (``dirty``: (group, block) -> index)."""

    __slots__ = ("req", "sched", "key", "plen", "blocks", "computed", "upto", "last", "dirty", "remote", "ids",
                 "loads", "unions")

    def __init__(self, req: str, sched: tuple, key: Any, plen: int) -> None:
        self.req, self.sched, self.key, self.plen = req, sched, key, plen
        self.blocks: list[list[int]] = []
        self.computed: int | None = None  # tokens computed before its next step (at least)
        self.upto = 0  # ... and at most
        self.last: dict[Any, int] = {}  # step -> computed tokens before it, for its last few steps
        self.dirty: dict[tuple, int] = {}
        self.remote: tuple = (None, None)  # (P's request id, P's engine id) from its transfer params
        self.ids: dict[str, int] = {}  # first events: add, alloc
        self.loads = False  # its connector's load lists are known (nixl.remote_alloc)
        self.unions: list[tuple] = []  # its labels made one with P's (let go with the request)


class Sched:
    """One scheduler's blocks, requests and configuration."""

    __slots__ = ("key", "inst", "cfg", "blocks", "reqs", "holders", "failed", "reads_seen", "used", "groups",
                 "inflight", "pending", "reading")

    def __init__(self, key: tuple, inst: str, cfg: dict) -> None:
        self.key, self.inst, self.cfg = key, inst, cfg
        self.blocks: dict[int, Block] = {}
        self.reqs: dict[str, Req] = {}
        self.holders: dict[int, dict[str, tuple]] = {}  # block -> {request: (group, index)}
        self.failed: dict[int, tuple] = {}  # rollback step -> (failed block ids, kvload.handled id)
        self.reads_seen = False  # a worker of this instance recorded a NIXL read
        self.used = False  # a request was added to it
        self.groups: dict[int, tuple] = {}  # group -> (token-indexed attention?, block size, window, kind)
        # writes of steps whose output is not processed yet (sched.output; only where the trace records it):
        # block -> [(step, request, first offset, end offset, sched.step id, its token-block index)], and step ->
        # the blocks it writes
        self.inflight: dict[int, list[tuple]] = {}
        self.pending: dict[Any, list[int]] = {}
        # ... and step -> {request: (the most tokens it may have computed before that step, sched.step id)}: where
        # the step's window starts at the latest (a step in flight still reads from there)
        self.reading: dict[Any, dict[str, tuple]] = {}

    def group(self, g: int) -> tuple:
        """Group ``g``'s (attention?, block size, window, kind) from the config, read once."""
        t = self.groups.get(g)
        if t is None:
            kinds, wins = self.cfg.get("group_kinds") or [], self.cfg.get("windows") or []
            kind = kinds[g] if g < len(kinds) else None
            t = self.groups[g] = (is_attention_group(kind), block_size(self.cfg, g), wins[g] if g < len(wins) else 0,
                                  str(kind or ""))
        return t

    def block(self, b: int) -> Block:
        """Block ``b``'s state, made on first sight."""
        blk = self.blocks.get(b)
        if blk is None:
            blk = self.blocks[b] = Block()
        return blk


def _unjudged(s: Sched, r: Req, label: Any) -> str:
    """Why a read of a block that holds ``label`` cannot be judged ('' when it can)."""
    if label == "unknown":
        return "transfer whose source is not in the trace (a P instance not recorded, or P's push trim not yet)"
    if label == AWAITING and not r.loads:
        return "no nixl.remote_alloc: which blocks D's connector loads into is not recorded"
    if label == PENDING and not s.reads_seen:
        return "no NIXL read recorded on D's workers, nor a push-mode write from P (the worker side is not in the trace)"
    return ""
