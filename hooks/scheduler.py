"""Scheduler-side hooks (engine-core process): vLLM 0.32.0 ``vllm.v1.core.sched.scheduler``
and ``vllm.v1.core.kv_cache_manager``.

Targets (all verified against the installed 0.32.0):
- ``Scheduler.__init__``                 -> ``sched.config`` (+ process role engine-core)
- ``Scheduler.schedule``                 -> ``sched.step`` (per-scheduler step counter)
- ``Scheduler.add_request``              -> ``req.add``
- ``Scheduler._free_request``            -> ``req.finish`` (every finish path goes through it)
- ``Scheduler._free_request_blocks``     -> ``sched.free`` (immediate and deferred frees)
- ``KVCacheManager.allocate_slots``      -> ``sched.alloc``

Two schedulers (P and D) may live in one process (tests, the scenario harness), so every
event names its own scheduler's instance (``inst=``, from that scheduler's kv_role) and
step (``step=``, the ``_pdtrace_step`` attribute kept on the scheduler object) explicitly.
The KV cache manager and the connector get a back reference ``_pdtrace_sched`` to their
scheduler so hooks on them (here and in ``hooks/nixl.py``) can do the same.
"""

from __future__ import annotations

from typing import Any

from pdtrace import schema
from pdtrace.redact import summarize_kv_params, token_hash

from . import after, around, register

SCHED_MOD = "vllm.v1.core.sched.scheduler"
KVM_MOD = "vllm.v1.core.kv_cache_manager"

_ROLE_TO_INST = {
    "kv_producer": schema.INST_P,
    "kv_consumer": schema.INST_D,
    "kv_both": schema.INST_BOTH,
}


def inst_for_kv_role(kv_role: str | None) -> str:
    return _ROLE_TO_INST.get(kv_role or "", schema.INST_NONE)


def _kv_role(vllm_config: Any) -> str:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return (getattr(ktc, "kv_role", None) or "") if ktc is not None else ""


def sched_inst(sched: Any) -> str:
    inst = getattr(sched, "_pdtrace_inst", None)
    if inst is None:
        inst = inst_for_kv_role(_kv_role(getattr(sched, "vllm_config", None)))
    return inst


def sched_step(sched: Any) -> int | None:
    return getattr(sched, "_pdtrace_step", None)


def _ids(blocks: Any) -> list[list[int]]:
    """KVCacheBlocks (or a tuple of id lists) -> list of id lists per group."""
    if blocks is None:
        return []
    if hasattr(blocks, "get_block_ids"):
        return [list(g) for g in blocks.get_block_ids()]
    return [list(g) for g in blocks]


# --- Scheduler.__init__ -----------------------------------------------------------------

def _init_after(rec: Any, _result: Any, self: Any, vllm_config: Any, kv_cache_config: Any, *a: Any, **kw: Any) -> None:
    kv_role = _kv_role(vllm_config)
    inst = inst_for_kv_role(kv_role)
    self._pdtrace_inst = inst
    self._pdtrace_step = 0
    kvm = getattr(self, "kv_cache_manager", None)
    if kvm is not None:
        kvm._pdtrace_sched = self
    conn = getattr(self, "connector", None)
    if conn is not None:
        conn._pdtrace_sched = self
        cs = getattr(conn, "connector_scheduler", None)
        if cs is not None:
            cs._pdtrace_sched = self
    rec.set_role(role=schema.ROLE_ENGINE, inst=inst, why=f"{type(self).__name__} constructed")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    spec_cfg = getattr(vllm_config, "speculative_config", None)
    sched_cfg = getattr(vllm_config, "scheduler_config", None)
    rec.emit(
        "sched.config",
        step=0,
        inst=inst,
        block_sizes=[int(g.kv_cache_spec.block_size) for g in groups],
        group_kinds=[type(g.kv_cache_spec).__name__ for g in groups],
        num_lookahead_tokens=int(getattr(self, "num_lookahead_tokens", 0) or 0),
        num_spec_tokens=int(getattr(self, "num_spec_tokens", 0) or 0),
        spec_method=(getattr(spec_cfg, "method", "") or "") if spec_cfg is not None else "",
        kv_role=kv_role,
        connector=type(conn).__name__ if conn is not None else "",
        async_scheduling=bool(getattr(sched_cfg, "async_scheduling", False)),
        num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
    )


register("scheduler.init", SCHED_MOD, "Scheduler.__init__",
         ("vllm_config", "kv_cache_config", "structured_output_manager", "block_size"),
         after("scheduler.init", _init_after),
         doc="sched.config: block sizes, spec method, lookahead, kv_role, connector")


# --- Scheduler.schedule -----------------------------------------------------------------

def _schedule_before(rec: Any, self: Any, *a: Any, **kw: Any) -> int:
    step = getattr(self, "_pdtrace_step", 0) + 1
    self._pdtrace_step = step
    rec.step = step
    return step


def _schedule_after(rec: Any, step: Any, out: Any, self: Any, *a: Any, **kw: Any) -> None:
    if out is None:
        return
    tokens = out.num_scheduled_tokens
    fields: dict[str, Any] = {}
    spec = out.scheduled_spec_decode_tokens
    if spec:
        fields["spec"] = {rid: len(ids) for rid, ids in spec.items()}
    fin = out.finished_req_ids
    if fin:
        fields["finished"] = list(fin)
    rec.emit("sched.step", step=step, inst=sched_inst(self), num_reqs=len(tokens),
             num_tokens=out.total_num_scheduled_tokens, tokens=dict(tokens), **fields)


register("scheduler.schedule", SCHED_MOD, "Scheduler.schedule", (),
         around("scheduler.schedule", _schedule_before, _schedule_after),
         doc="sched.step; advances the per-scheduler step counter")


# --- Scheduler.add_request ----------------------------------------------------------------

def _add_after(rec: Any, _result: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    ids = request.prompt_token_ids
    fields: dict[str, Any] = {}
    kv = summarize_kv_params(request.kv_transfer_params)
    if kv is not None:
        fields["kv"] = kv
    mt = getattr(request, "max_tokens", None)
    if mt is not None:
        fields["max_tokens"] = int(mt)
    if not rec.redact and ids is not None:
        fields["prompt_ids"] = list(ids)
    rec.emit("req.add", req=request.request_id, step=sched_step(self), inst=sched_inst(self),
             prompt_len=int(request.num_prompt_tokens), prompt_hash=token_hash(ids), **fields)


register("scheduler.add_request", SCHED_MOD, "Scheduler.add_request", ("request",),
         after("scheduler.add_request", _add_after), doc="req.add")


# --- Scheduler._free_request (finish) ---------------------------------------------------------

def _finish_before(rec: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    st = request.status
    rec.emit("req.finish", req=request.request_id, step=sched_step(self), inst=sched_inst(self),
             status=getattr(st, "name", str(st)), num_computed_tokens=int(request.num_computed_tokens),
             num_output_tokens=int(request.num_output_tokens))


def _noop_after(rec: Any, state: Any, result: Any, *a: Any, **kw: Any) -> None:
    return None


register("scheduler.finish", SCHED_MOD, "Scheduler._free_request", ("request",),
         around("scheduler.finish", _finish_before, _noop_after),
         doc="req.finish (before the connector's request_finished runs)")


# --- Scheduler._free_request_blocks (free) -----------------------------------------------------

def _free_before(rec: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    ids = self.kv_cache_manager.get_block_ids(request.request_id)
    rec.emit("sched.free", req=request.request_id, step=sched_step(self), inst=sched_inst(self),
             block_ids=[list(g) for g in ids])


register("scheduler.free", SCHED_MOD, "Scheduler._free_request_blocks", ("request",),
         around("scheduler.free", _free_before, _noop_after),
         doc="sched.free: blocks held just before the free")


# --- KVCacheManager.allocate_slots ------------------------------------------------------------

def _alloc_after(rec: Any, result: Any, self: Any, request: Any, num_new_tokens: int,
                 num_new_computed_tokens: int = 0, new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                 num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                 *a: Any, **kw: Any) -> None:
    """sched.alloc, emitted when the request's block list can have changed.

    A decode-step call that succeeded, allocated no new block, and loaded nothing (no
    prefix hit, no external tokens, not the first scheduling) leaves every group's block
    list as the previous sched.alloc recorded it, so it is not recorded again: the latest
    sched.alloc of a request is always its current allocation. This keeps the per-step cost
    of the hook off the hot decode path (bench/hooks.py).
    """
    ok = result is not None
    # allocate_slots does not change num_computed_tokens (the scheduler updates it after schedule())
    num_computed = request.num_computed_tokens
    if ok and num_computed and not num_external_computed_tokens and not num_new_computed_tokens:
        for g in result.blocks:
            if g:
                break
        else:
            return
    sched = getattr(self, "_pdtrace_sched", None)
    if sched is not None:
        inst = sched_inst(sched)
        step = sched_step(sched)
        sched_la = int(getattr(sched, "num_lookahead_tokens", 0) or 0)
    else:
        inst, step, sched_la = rec.inst, None, int(num_lookahead_tokens)
    rid = request.request_id
    rec.put("sched.alloc", rid, step, {
        "inst": inst,
        "ok": ok,
        "block_ids": [list(g) for g in self.get_block_ids(rid)] if ok else [],
        "new_block_ids": _ids(result) if ok else [],
        "num_computed_tokens": int(num_computed),
        "num_new_tokens": int(num_new_tokens),
        "num_lookahead_tokens": int(num_lookahead_tokens),
        "sched_lookahead_tokens": sched_la,
        "num_external_computed_tokens": int(num_external_computed_tokens),
        "num_new_computed_tokens": int(num_new_computed_tokens),
        "delay_cache_blocks": bool(delay_cache_blocks),
        "prompt_len": int(request.num_prompt_tokens),
    })


register("scheduler.allocate_slots", KVM_MOD, "KVCacheManager.allocate_slots",
         ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
          "num_external_computed_tokens", "delay_cache_blocks"),
         after("scheduler.allocate_slots", _alloc_after),
         doc="sched.alloc: blocks per group after the call, lookahead asked for vs the scheduler's")
