"""A tiny builder of schema-valid events for unit tests (detectors, viewers, CLI).

``EventBuilder.add(kind, ...)`` fills the common fields (t, w, pid, role, inst, id) and
checks the event against ``pdtrace.schema`` so a test can never feed a detector an event
the loader would reject. The scenario helpers below replay, in plain Python, what the
vLLM code paths of each seed thread emit; each takes a ``fixed`` switch selecting the
upstream-fixed behaviour, so tests compare buggy vs fixed traces of the same situation.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from pdtrace.record import recorder
from pdtrace import schema
from pdtrace.record.recorder import Recorder
from pdtrace.tracefile.trace import make_footer, make_header, write_trace

ENGINE_KINDS = ("sched.", "req.", "nixl.request_finished", "nixl.remote_alloc", "nixl.send_done")
_PIDS = {("P", "engine-core"): 100, ("P", "worker"): 110, ("D", "engine-core"): 200, ("D", "worker"): 210,
         ("PD", "engine-core"): 300, ("PD", "worker"): 310}

VERSIONS = {"vllm": "0.32.0", "torch": "2.13.0", "nixl": "1.5.1", "python": "3.11", "pdtrace": "0.1.0"}


class EventBuilder:
    def __init__(self, t0: int = 1_000_000_000):
        self.events: list[dict[str, Any]] = []
        self.t = t0

    def add(self, kind: str, *, inst: str = "P", role: str | None = None, pid: int | None = None,
            rank: int | None = None, req: str | None = None, step: int | None = None, **fields: Any) -> dict:
        if role is None:
            role = "engine-core" if kind.startswith(ENGINE_KINDS) else "worker"
        if pid is None:
            pid = _PIDS.get((inst, role), 999) + (rank or 0)
        self.t += 1000
        ev: dict[str, Any] = {"ev": kind, "t": self.t, "w": self.t + 1_700_000_000_000_000_000,
                              "pid": pid, "role": role, "inst": inst}
        if rank is not None:
            ev["rank"] = rank
        if step is not None:
            ev["step"] = step
        if req is not None:
            ev["req"] = req
        ev.update(fields)
        ev["id"] = len(self.events)
        why = schema.validate_event(ev)
        assert why is None, why
        self.events.append(ev)
        return ev

    def config(self, inst: str = "P", *, block_sizes=(16,), group_kinds=None, num_spec_tokens: int = 3,
               spec_method: str = "eagle3", lookahead: int | None = None, kv_role: str | None = None,
               async_scheduling: bool = False, num_blocks: int = 1000) -> dict:
        kinds = list(group_kinds) if group_kinds is not None else ["FullAttentionSpec"] * len(block_sizes)
        role = kv_role or {"P": "kv_producer", "D": "kv_consumer", "PD": "kv_both"}.get(inst, "")
        return self.add("sched.config", inst=inst, block_sizes=list(block_sizes), group_kinds=kinds,
                        num_lookahead_tokens=num_spec_tokens if lookahead is None else lookahead,
                        num_spec_tokens=num_spec_tokens, spec_method=spec_method, kv_role=role,
                        connector="NixlConnector" if role else "", async_scheduling=async_scheduling,
                        num_blocks=num_blocks)

    def header(self, origin: str = "synthetic") -> dict:
        return make_header(origin=origin, cmd=["pytest"], versions=dict(VERSIONS), instances=["P", "D"])

    def write(self, path, origin: str = "synthetic") -> str:
        write_trace(str(path), self.header(origin), self.events, make_footer(self.events), assign_ids=False)
        return str(path)


def kv_load_hooks(b: EventBuilder, inst: str = "D") -> dict:
    """The hooks.status D's engine core writes when its hooks are installed, as far as the
    KV-load class reads it: the scheduler's failure handlers applied (no load failed, so no
    kvload.* event follows)."""
    return b.add("hooks.status", inst=inst, role="engine-core", vllm="0.32.0",
                 applied=["kv_load.invalid_blocks", "kv_load.failed_recving"], skipped={})


def _is_state(kind: str) -> bool:
    return "Mamba" in kind or "SSM" in kind


# --------------------------------------------------------------------------------------
# 000/001: P reports lookahead blocks, D end-trims
# --------------------------------------------------------------------------------------

def lookahead_scenario(b: EventBuilder | None = None, *, prompt_len: int = 16, block_sizes=(16,),
                       group_kinds=None, lookahead: int = 1, fixed: bool = False, d_cached_blocks: int = 0,
                       req: str = "r1", d_req: str | None = None, p_first_block: int = 10,
                       d_first_block: int = 50, step: int = 3, d_side: bool = True,
                       trim: bool = True, read: bool = True, steps: bool = False) -> EventBuilder:
    """P prefills ``req`` with ``lookahead`` spec slots; D pulls it.

    P allocates ceil((prompt_len + lookahead) / B) blocks per attention group (one state
    block per Mamba group) and reports all of them (``fixed=False``) or the blocks covering
    ``prompt_len`` (``fixed=True``). D allocates the blocks covering the prompt minus
    ``d_cached_blocks`` prefix-cache hits, then end-trims as ``_apply_prefix_caching`` does.
    ``steps``: also the scheduler's steps that read the KV (P's prefill, D's allocation and first decode
    step), which the KV invariant (kv-invariant) judges; without them it is "not checked".
    """
    b = b or EventBuilder()
    kinds = list(group_kinds) if group_kinds is not None else ["FullAttentionSpec"] * len(block_sizes)
    d_req = d_req or req
    if not any(e["ev"] == "sched.config" and e["inst"] == "P" for e in b.events):
        b.config("P", block_sizes=block_sizes, group_kinds=kinds)
        b.config("D", block_sizes=block_sizes, group_kinds=kinds, lookahead=0)
        kv_load_hooks(b)
    p_blocks, reported, d_blocks, d_full = [], [], [], []
    nb = p_first_block
    db = d_first_block
    for B, kind in zip(block_sizes, kinds):
        if _is_state(kind):
            n_alloc = n_needed = 1
            n_local = 1
        else:
            n_alloc = math.ceil((prompt_len + lookahead) / B)
            n_needed = math.ceil(prompt_len / B)
            n_local = n_needed - d_cached_blocks
        blocks = list(range(nb, nb + n_alloc))
        nb += n_alloc + 3
        p_blocks.append(blocks)
        reported.append(blocks if (not fixed or _is_state(kind)) else blocks[:n_needed])
        d_blocks.append(list(range(db, db + n_local)))
        # what the hook records in nixl.remote_alloc: D's whole list (KVCacheBlocks.get_block_ids(): the
        # prefix-cache hits first, then the blocks to load)
        d_full.append(d_blocks[-1] if _is_state(kind) else list(range(900 + db, 900 + db + d_cached_blocks))
                      + d_blocks[-1])
        db += n_local + 5
    b.add("req.add", inst="P", req=req, step=step - 1, prompt_len=prompt_len, prompt_hash="h",
          kv={"do_remote_decode": True})
    b.add("sched.alloc", inst="P", req=req, step=step - 1, ok=True, block_ids=p_blocks, new_block_ids=p_blocks,
          num_computed_tokens=0, num_new_tokens=prompt_len, num_lookahead_tokens=lookahead,
          sched_lookahead_tokens=lookahead, num_external_computed_tokens=0, num_new_computed_tokens=0,
          delay_cache_blocks=False, prompt_len=prompt_len)
    if steps:
        b.add("sched.step", inst="P", step=step - 1, num_reqs=1, num_tokens=prompt_len, tokens={req: prompt_len})
    b.add("nixl.request_finished", inst="P", req=req, step=step, side="P", allocated_block_ids=p_blocks,
          arg_block_ids=p_blocks, block_ids=reported, remote_num_tokens=prompt_len,
          num_computed_tokens=prompt_len, prompt_len=prompt_len, delay_free=True)
    if not d_side:
        return b
    ext = prompt_len - d_cached_blocks * block_sizes[0]
    if steps:
        b.add("req.add", inst="D", req=d_req, step=step, prompt_len=prompt_len, prompt_hash="h",
              kv={"do_remote_prefill": True, "remote_request_id": req, "remote_engine_id": "P0"})
        b.add("sched.alloc", inst="D", req=d_req, step=step + 1, ok=True, block_ids=d_full, new_block_ids=d_full,
              num_computed_tokens=0, num_new_tokens=0, num_lookahead_tokens=0, sched_lookahead_tokens=0,
              num_external_computed_tokens=ext, num_new_computed_tokens=prompt_len - ext, delay_cache_blocks=True,
              prompt_len=prompt_len)
    b.add("nixl.remote_alloc", inst="D", req=d_req, step=step + 1, local_block_ids=d_full,
          remote_block_ids=reported, remote_num_tokens=prompt_len,
          num_external_tokens=prompt_len - d_cached_blocks * block_sizes[0], remote_req=req, remote_engine="P0")
    local_out, remote_out = [], []
    for lo, ro, kind in zip(d_blocks, reported, kinds):  # vLLM's end-trim (state groups untouched)
        local_out.append(lo)
        remote_out.append(ro if _is_state(kind) or len(lo) >= len(ro) else ro[-len(lo):])
    if trim:
        b.add("nixl.trim", inst="D", req=d_req, step=step + 1, local_in=d_blocks, remote_in=reported,
              local_out=local_out, remote_out=remote_out, mamba=any(_is_state(k) for k in kinds))
    if read:
        b.add("nixl.read", inst="D", req=d_req, step=step + 1, local_block_ids=local_out,
              remote_block_ids=remote_out, bytes=0, handle="h1", remote_engine="P0", remote_req=req)
        b.add("nixl.read_done", inst="D", req=d_req, step=step + 2, status="DONE", handle="h1")
    if steps:
        b.add("sched.step", inst="D", step=step + 3, num_reqs=1, num_tokens=1, tokens={d_req: 1})
    return b


# --------------------------------------------------------------------------------------
# 002: connector metadata cleared before the drafter forward
# --------------------------------------------------------------------------------------

def metadata_scenario(b: EventBuilder | None = None, *, fixed: bool = False, inst: str = "P", step: int = 1,
                      target_layers=("model.layers.0.attn", "model.layers.1.attn"),
                      drafter_layers=("drafter.layers.0.attn",), reqs=("r1",), rank: int | None = None,
                      n_save: int | None = None) -> EventBuilder:
    """One worker step: bind, target forward (saves each layer), drafter forward, clear.

    Buggy: ``clear_connector_metadata`` runs between the target and the drafter, so every
    drafter layer's ``has_connector_metadata()`` is False and nothing is saved. Fixed: the
    clear runs after the drafter proposes.
    """
    b = b or EventBuilder()
    saves = inst in ("P", "PD")
    ns = (len(reqs) if saves else 0) if n_save is None else n_save
    kw = dict(inst=inst, step=step, rank=rank)
    b.add("kvmeta.bind", connector="NixlConnectorWorker", n_recv=0 if saves else len(reqs), n_save=ns,
          n_send=0, reqs=list(reqs), **kw)
    b.add("spec.phase", phase="target", edge="begin", layers=list(target_layers), **kw)
    for layer in target_layers:
        b.add("kvmeta.has", result=True, phase="target", **kw)
        if saves:
            b.add("kvmeta.save_layer", layer=layer, phase="target", **kw)
    b.add("spec.phase", phase="target", edge="end", **kw)
    if not fixed:
        b.add("kvmeta.clear", phase="", **kw)
    b.add("spec.phase", phase="drafter", edge="begin", method="eagle3", layers=list(drafter_layers), **kw)
    for layer in drafter_layers:
        b.add("kvmeta.has", result=fixed, phase="drafter", **kw)
        if fixed and saves:
            b.add("kvmeta.save_layer", layer=layer, phase="drafter", **kw)
    b.add("spec.phase", phase="drafter", edge="end", method="eagle3", **kw)
    if fixed:
        b.add("kvmeta.clear", phase="", **kw)
    b.add("kvmeta.wait_for_save", phase="", **kw)
    return b


# --------------------------------------------------------------------------------------
# 003: DFlash drafter writes past the allocation
# --------------------------------------------------------------------------------------

def window_scenario(b: EventBuilder | None = None, *, fixed: bool = False, prompt_len: int = 16,
                    block_size: int = 16, num_spec_tokens: int = 3, inst: str = "PD") -> EventBuilder:
    """Row 0 first holds ``old`` (blocks [5, 6, 7]); ``old`` finishes while its blocks 5 and 6
    stay in the prefix cache and are reused by ``a`` and ``b`` (shared). ``new`` then takes
    row 0 and prefills ``prompt_len`` tokens; DFlash writes KV for positions
    [prompt_len, prompt_len + k + 1). Buggy: the scheduler reserved no lookahead slots for
    the first prefill. Fixed: it reserved k + 1.
    """
    b = b or EventBuilder()
    k = num_spec_tokens
    b.config(inst, block_sizes=(block_size,), spec_method="dflash", num_spec_tokens=k, lookahead=k + 1)

    def alloc(req, step, blocks, lookahead):
        b.add("sched.alloc", inst=inst, req=req, step=step, ok=True, block_ids=[blocks], new_block_ids=[blocks],
              num_computed_tokens=0, num_new_tokens=prompt_len, num_lookahead_tokens=lookahead,
              sched_lookahead_tokens=k + 1, num_external_computed_tokens=0, num_new_computed_tokens=0,
              delay_cache_blocks=False, prompt_len=prompt_len)

    alloc("old", 1, [5, 6, 7], k + 1)
    b.add("batch.add", inst=inst, req="old", step=1, row=0)
    b.add("sched.free", inst=inst, req="old", step=2, block_ids=[[5, 6, 7]])
    b.add("batch.remove", inst=inst, req="old", step=2, row=0)
    alloc("a", 2, [6, 20], k + 1)  # prefix hit on block 6
    alloc("b", 2, [6, 21], k + 1)
    n = math.ceil((prompt_len + (k + 1 if fixed else 0)) / block_size)
    new_blocks = list(range(30, 30 + n))
    alloc("new", 3, new_blocks, k + 1 if fixed else 0)
    b.add("batch.add", inst=inst, req="new", step=3, row=0)
    b.add("spec.window", inst=inst, req="new", step=3, start=prompt_len, end=prompt_len + k + 1, method="dflash",
          group=0)
    return b


# --------------------------------------------------------------------------------------
# 004: async spec decode reads a stale accepted count
# --------------------------------------------------------------------------------------

def stale_read_scenario(b: EventBuilder | None = None, *, move: str | None = None, event_done: bool = True,
                        synced: bool | None = None, fixed: bool = False, inst: str = "D", step: int = 5,
                        truths: dict[str, int] | None = None, landed: str | None = "after") -> EventBuilder:
    """Rows 0/1/2 hold r1/r2/r3 (accepted 1, 4, 2) when the D2H copy is issued at step-1.

    ``landed``: where the copy landed relative to the row move, as the hooks record it:
    "after" (the move carries ``landed: after``; d2h.done follows it), "before" (d2h.done
    precedes the move), None (a recording from before the field: the order is unknown).

    ``move``: None (no row change; the request read is r1), 'swap' (swap_states(0, 1); r1
    is read), 'condense' (r2 leaves, condense moves r3 from row 2 to row 1; r3 is read).
    Buggy: the read uses the request's row *now* against the buffer laid out at issue time
    (and, with ``event_done=False``, before the copy completed). Fixed: the read uses the
    row the request had at issue time.
    """
    b = b or EventBuilder()
    truths = truths if truths is not None else {"r1": 1, "r2": 4, "r3": 2}
    order = ["r1", "r2", "r3"]
    for row, r in enumerate(order):
        b.add("batch.add", inst=inst, req=r, step=step - 2, row=row)
    b.add("d2h.issue", inst=inst, step=step - 1, buf="num_accepted_tokens_cpu", rows=list(order), event="ev7")
    for r in order:
        b.add("acc.truth", inst=inst, req=r, step=step, value=truths[r], for_step=step - 1)
    target, row_now = "r1", 0
    lf: dict[str, Any] = {"copy": "ev7", "landed": landed} if landed in ("after", "unknown") else {}
    if event_done and landed == "before" and move:
        b.add("d2h.done", inst=inst, step=step, event="ev7")
    if move == "swap":
        b.add("batch.swap", inst=inst, step=step, i1=0, i2=1, req1="r1", req2="r2", **lf)
        row_now = 1
    elif move == "condense":
        b.add("batch.remove", inst=inst, req="r2", step=step, row=1)
        b.add("batch.condense", inst=inst, step=step, moves=[["r3", 2, 1]], **lf)
        target, row_now = "r3", 1
    if event_done and not (landed == "before" and move):
        b.add("d2h.done", inst=inst, step=step, event="ev7")
    row = order.index(target) if fixed else row_now
    fields: dict[str, Any] = {"event": "ev7", "event_done": event_done}
    if synced is not None:
        fields["synced"] = synced
    b.add("acc.read", inst=inst, req=target, step=step, row=row, value=truths[order[row]], **fields)
    return b


def recorded(r: Any, *kinds: str) -> list[dict]:
    """Flush an in-memory recorder; its events (of ``kinds``, or all), each schema-valid."""
    r.flush()
    out = [e for e in r.events if not kinds or e["ev"] in kinds]
    for e in out:
        assert schema.validate_event(e) is None, e
    return out


class RaisingRecorder(Recorder):
    """A recorder whose emit raises for one kind: simulates a bug in a hook's recording code."""

    def __init__(self, bad_kind: str, **kw: Any):
        super().__init__(None, threaded=False, **kw)
        self.events: list = []
        self._sink = self.events.extend
        self.bad_kind = bad_kind

    def emit(self, kind, req=None, step=None, **fields):
        if kind == self.bad_kind:
            raise RuntimeError("boom in recording")
        super().emit(kind, req=req, step=step, **fields)

    def put(self, kind, req, step, fields):
        if kind == self.bad_kind:
            raise RuntimeError("boom in recording")
        super().put(kind, req, step, fields)


@pytest.fixture
def rec():
    """An in-memory recorder for a worker on P, made current for the test (shared by the
    worker-side hook tests: test_hooks_worker.py, the V2 tests through v2lib.py)."""
    r = Recorder.in_memory(role="worker", inst="P")
    prev = recorder.set_current(r)
    yield r
    recorder.set_current(prev)
