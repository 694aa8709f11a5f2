"""Scheduler-side hooks (engine-core process): vLLM 0.32.0 ``vllm.v1.core.sched.scheduler``
and ``vllm.v1.core.kv_cache_manager``.

Targets (all verified against the installed 0.32.0):
- ``Scheduler.__init__``                 -> ``sched.config`` (+ role engine-core; groups: kv_layout.py)
- ``Scheduler.schedule``                 -> ``sched.step`` (per-scheduler step counter)
- ``Scheduler.add_request``              -> ``req.add``
- ``Scheduler._free_request``            -> ``req.finish`` (every finish path goes through it)
- ``Scheduler._free_request_blocks``     -> ``sched.free`` (immediate and deferred frees)
- ``KVCacheManager.allocate_slots``      -> ``sched.alloc``

Two schedulers (P and D) may live in one process (tests, the harness), so every event names its scheduler's
instance (``inst=``, from its kv_role) and step (``step=``, ``_pdtrace_step`` kept on the scheduler). The KV cache
manager and the connector get a back reference ``_pdtrace_sched`` so hooks on them (``hooks/nixl.py``) can too.
"""

from __future__ import annotations

import os
from collections import deque
from itertools import compress
from time import monotonic_ns as _mono  # the recorder's clock
from typing import Any, NamedTuple

from pdtrace import schema
from pdtrace.record.recorder import GROW, PROMPT
from pdtrace.record.redact import summarize_kv_params, token_digest

from . import after, around, before, register
from .kv_layout import group_layout, step_budget

SCHED_MOD = "vllm.v1.core.sched.scheduler"
KVM_MOD = "vllm.v1.core.kv_cache_manager"

_ROLE_TO_INST = {
    "kv_producer": schema.INST_P,
    "kv_consumer": schema.INST_D,
    "kv_both": schema.INST_BOTH,
}


# `pdtrace record --instance NAME` (env PDTRACE_INSTANCE) names this process's instance
# outright: it wins over the kv_role, so xPyD runs can tell decoders D, D2, ... apart.
_FORCED_INST = os.environ.get("PDTRACE_INSTANCE") or ""


def inst_for_kv_role(kv_role: str | None) -> str:
    return _FORCED_INST or _ROLE_TO_INST.get(kv_role or "", schema.INST_NONE)


def _kv_role(vllm_config: Any) -> str:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return (getattr(ktc, "kv_role", None) or "") if ktc is not None else ""


def sched_inst(sched: Any) -> str:
    try:
        return sched._pdtrace_inst  # set by the Scheduler.__init__ hook
    except AttributeError:
        return inst_for_kv_role(_kv_role(getattr(sched, "vllm_config", None)))


def sched_step(sched: Any) -> int | None:
    return getattr(sched, "_pdtrace_step", None)


_sched_ids = iter(range(1, 1 << 62))  # per-process ordinal of traced Scheduler objects


def sched_ident(sched: Any) -> tuple[int | None, str | None]:
    """(per-process scheduler ordinal, KV-transfer engine id) of the scheduler, where known:
    two schedulers in one process (tests, harnesses) may reuse request ids."""
    return getattr(sched, "_pdtrace_sid", None), getattr(sched, "_pdtrace_engine", None)


# --- Scheduler.__init__ -----------------------------------------------------------------

def _init_after(rec: Any, _result: Any, self: Any, vllm_config: Any, kv_cache_config: Any, *a: Any, **kw: Any) -> None:
    kv_role = _kv_role(vllm_config)
    inst = inst_for_kv_role(kv_role)
    self._pdtrace_inst = inst
    self._pdtrace_step = 0
    self._pdtrace_sid = next(_sched_ids)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    engine = getattr(ktc, "engine_id", None) if ktc is not None else None
    self._pdtrace_engine = str(engine) if engine is not None else None
    kvm, conn = getattr(self, "kv_cache_manager", None), getattr(self, "connector", None)
    for obj in (kvm, conn, getattr(conn, "connector_scheduler", None)):
        if obj is not None:
            obj._pdtrace_sched = self
    rec.set_role(role=schema.ROLE_ENGINE, inst=inst, why=f"{type(self).__name__} constructed")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    self._pdtrace_bypass = _bypass_plan(self, kvm, groups)
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
        sched=self._pdtrace_sid,
        **({"engine": self._pdtrace_engine} if self._pdtrace_engine is not None else {}),
        **group_layout(groups, kv_cache_config, conn),
        **step_budget(sched_cfg),
    )


register("scheduler.init", SCHED_MOD, "Scheduler.__init__",
         ("vllm_config", "kv_cache_config", "structured_output_manager", "block_size"),
         after("scheduler.init", _init_after),
         doc="sched.config: block sizes, spec method, lookahead, kv_role, connector")


# --- Scheduler.schedule -----------------------------------------------------------------

def _schedule_before(rec: Any, self: Any, *a: Any, **kw: Any) -> tuple[int, int, Any]:
    step = getattr(self, "_pdtrace_step", 0) + 1
    self._pdtrace_step = step
    rec.step = step
    plan = getattr(self, "_pdtrace_bypass", None)
    if plan is not None and not self.waiting and not self.kv_holding_waiting:
        # No request waits, so this step's only allocate_slots calls are the running loop's,
        # whose successful calls the wrapper skips anyway; when the pool holds more free
        # blocks than that loop can ask for, none of them can fail either, and the step
        # calls the unwrapped method (``_bypass_plan``). Undone in _schedule_after.
        B = self.max_num_scheduled_tokens
        n = len(self.running)
        kvm = plan.kvm
        need = (B + n * (self.num_lookahead_tokens - 1)) * plan.inv_block_sizes + n * plan.groups
        if kvm.block_pool.get_num_free_blocks() >= need:
            kvm.allocate_slots = plan.original
            return step, _mono(), plan
    return step, _mono(), None


def _schedule_after(rec: Any, state: Any, out: Any, self: Any, *a: Any, **kw: Any) -> None:
    """sched.step, plus the blocks this step appended to running requests.

    A running request's allocate_slots call is not hooked (see ``_ALLOC_SKIP``): the blocks
    it appended are read here from what vLLM hands the workers,
    ``SchedulerOutput.scheduled_cached_reqs.new_block_ids`` (plain int lists vLLM built
    this step, None when a request got no new block), with each request's
    num_computed_tokens from the same object. They ride in the step event under
    ``recorder.GROW`` and become one short ``sched.alloc`` per request (``from_output``)
    when the queue is materialized, timed at the start of schedule() (the running
    requests' allocations come first in it). Resumed requests are left out: their
    allocation went through the hooked path and recorded its full list."""
    step, t0, bypassed = state
    if bypassed is not None:
        _end_bypass(bypassed)
    if out is None:
        return
    try:  # (id, step) of the latest outputs: the step whose output update_from_output gets (hooks/kv_load.py)
        self._pdtrace_outs.append((id(out), step))
    except AttributeError:  # the first step (or a scheduler built before the hooks were installed)
        self._pdtrace_outs = deque([(id(out), step)], maxlen=8)
    tokens = out.num_scheduled_tokens
    # tokens and spec are queued packed (recorder.unpack_step restores the dicts when the
    # queue is materialized): the request ids as a list and the counts as bytes -- a decode
    # step's counts are all < 256 -- cost C-level copies here and one string each for
    # marshal, where 256-entry dicts cost a Python-level build and a marshalled int each.
    keys = list(tokens)
    fields: dict[str, Any] = {"inst": sched_inst(self), "num_reqs": len(keys),
                              "num_tokens": out.total_num_scheduled_tokens,
                              "tokens": (keys, _small_ints(tokens.values()))}
    spec = out.scheduled_spec_decode_tokens
    if spec:
        skeys = list(spec)
        fields["spec"] = (None if skeys == keys else skeys, _small_ints(list(map(len, spec.values()))))
    fin = out.finished_req_ids
    if fin:
        fields["finished"] = list(fin)
    cached = out.scheduled_cached_reqs
    nb = cached.new_block_ids
    if nb:
        # (None for a request that got no new block; a tuple of per-group lists is truthy)
        rows = list(compress(zip(cached.req_ids, cached.num_computed_tokens, nb), nb))
        if rows:
            resumed = cached.resumed_req_ids
            if resumed:
                rows = [row for row in rows if row[0] not in resumed]
            fields[GROW] = (t0, getattr(self, "num_lookahead_tokens", 0), rows)
    rec.put("sched.step", None, step, fields)


def _small_ints(values: Any) -> Any:
    """``values`` (iterable twice) as bytes when every one is in 0..255, else as a list."""
    try:
        return bytes(values)
    except (ValueError, TypeError):  # e.g. a prefill chunk's count >= 256
        return list(values)


register("scheduler.schedule", SCHED_MOD, "Scheduler.schedule", (),
         around("scheduler.schedule", _schedule_before, _schedule_after),
         doc="sched.step; advances the per-scheduler step counter; running requests' new blocks")


# --- Scheduler.add_request ----------------------------------------------------------------

def _add_after(rec: Any, _result: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    ids = request.prompt_token_ids
    # the prompt's tuple hash (one C-level pass over the ids, cheaper than the block hashes
    # vLLM computes for the same prompt); materialize turns it into prompt_hash (blake2b)
    fields: dict[str, Any] = {"inst": sched_inst(self), "prompt_len": request.num_prompt_tokens,
                              PROMPT: token_digest(ids)}
    kv = summarize_kv_params(request.kv_transfer_params)
    if kv is not None:
        fields["kv"] = kv
    mt = getattr(request, "max_tokens", None)
    if mt is not None:
        fields["max_tokens"] = mt
    if not rec.redact and ids is not None:
        fields["prompt_ids"] = list(ids)
    rec.put("req.add", request.request_id, sched_step(self), fields)


register("scheduler.add_request", SCHED_MOD, "Scheduler.add_request", ("request",),
         after("scheduler.add_request", _add_after), doc="req.add")


# --- Scheduler._free_request (finish) ---------------------------------------------------------

def _finish_before(rec: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    st = request.status
    rec.put("req.finish", request.request_id, sched_step(self), {
        "inst": sched_inst(self),
        # an Enum member's _name_ is a plain attribute; .name is a Python-level property
        "status": getattr(st, "_name_", None) or str(st),
        "num_computed_tokens": request.num_computed_tokens, "num_output_tokens": request.num_output_tokens})


register("scheduler.finish", SCHED_MOD, "Scheduler._free_request", ("request",),
         before("scheduler.finish", _finish_before),
         doc="req.finish (before the connector's request_finished runs)")


# --- Scheduler._free_request_blocks (free) -----------------------------------------------------

def _free_before(rec: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    rid = request.request_id
    kvm = self.kv_cache_manager
    plan = getattr(self, "_pdtrace_bypass", None)
    if plan is not None and kvm.allocate_slots is plan.original:
        # a preemption inside a bypassed schedule(): an allocation failed although
        # _bypass_plan's bound said none could. Say so; record the rest of the step.
        _end_bypass(plan)
        rec.hook_error("scheduler.allocate_slots", RuntimeError(
            f"request {rid} preempted on step {sched_step(self)}, whose running requests' allocate_slots "
            "calls were not wrapped (free-block bound); the failed allocations before it are not in the trace"))
    rec.put("sched.free", rid, sched_step(self),
            {"inst": sched_inst(self), "block_ids": _held_ids(kvm, rid)})


register("scheduler.free", SCHED_MOD, "Scheduler._free_request_blocks", ("request",),
         before("scheduler.free", _free_before),
         layouts=((SCHED_MOD, "Scheduler._free_blocks", ("request",), "0.22.1-0.23.0: the free is inline there"),),
         doc="sched.free: blocks held just before the free")


# --- KVCacheManager.allocate_slots ------------------------------------------------------------

def _alloc_after(rec: Any, result: Any, self: Any, request: Any, num_new_tokens: int,
                 num_new_computed_tokens: int = 0, new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                 num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                 *a: Any, **kw: Any) -> None:
    """sched.alloc, emitted when the request's block list can have changed.

    A successful call for a RUNNING request can only append blocks; it is not recorded
    here (the wrapper skips it, ``_ALLOC_SKIP``): the scheduler hook reads what it appended
    from the step's ``SchedulerOutput`` (``_schedule_after``), once per step instead of
    once per request. Every other call records. One that still only appends (a request
    that has computed tokens but is not running yet, e.g. on D after its remote KV load)
    records a short event with ``new_block_ids`` and without ``block_ids`` when it appended
    some, nothing when it appended none (the loader derives block_ids from the request's
    previous sched.alloc, schema v2). First scheduling, prefix hit, remote load and
    failure record the full list. So the latest sched.alloc of a request is always its
    current allocation. Block ids are read on the caller's thread (``_held_ids``).
    """
    ok = result is not None
    if ok and request.status is _RUNNING:
        return  # recorded from the step's SchedulerOutput (the inlined skip does the same)
    # allocate_slots does not change num_computed_tokens (the scheduler updates it after schedule())
    num_computed = request.num_computed_tokens
    running = ok and num_computed and not num_external_computed_tokens and not num_new_computed_tokens
    if running and not any(result.blocks):
        return
    sched = getattr(self, "_pdtrace_sched", None)
    try:  # both set by the Scheduler.__init__ hook
        inst = sched._pdtrace_inst
        step = sched._pdtrace_step
    except AttributeError:
        if sched is not None:
            inst, step = sched_inst(sched), sched_step(sched)
        else:
            inst, step = rec.inst, None
    rid = request.request_id
    if running:
        # Only appends new blocks to the list it held (the previous sched.alloc of this
        # request says which): the file keeps the new ones and the loader derives
        # block_ids (schema v2). (a block or two: reading the ids now is cheaper than
        # deferring them)
        rec.put("sched.alloc", rid, step, {
            "inst": inst, "ok": True, "new_block_ids": _ids_per_group(result.blocks),
            "num_computed_tokens": num_computed, "num_new_tokens": num_new_tokens,
            "num_lookahead_tokens": num_lookahead_tokens,
        })
        return
    sched_la = int(getattr(sched, "num_lookahead_tokens", 0) or 0) if sched is not None else int(num_lookahead_tokens)
    if ok:
        new_ids = _ids_per_group(result.blocks)
        held = _held_ids(self, rid)
    else:
        new_ids = held = []
    rec.put("sched.alloc", rid, step, {
        "inst": inst,
        "ok": ok,
        "block_ids": held,
        "new_block_ids": new_ids,
        "num_computed_tokens": num_computed,
        "num_new_tokens": num_new_tokens,
        "num_lookahead_tokens": num_lookahead_tokens,
        "sched_lookahead_tokens": sched_la,
        "num_external_computed_tokens": num_external_computed_tokens,
        "num_new_computed_tokens": num_new_computed_tokens,
        "delay_cache_blocks": bool(delay_cache_blocks),
        "prompt_len": request.num_prompt_tokens,
    })


# Inlined into the generated wrapper: a running request's successful call (every decode
# step's call) costs one expression, not a call into _alloc_after; what it appended is read
# from the step's SchedulerOutput (_schedule_after).
_ALLOC_SKIP = "_pdt_result is not None and request.status is _pdt_RUNNING"


_RUNNING: Any = object()  # vllm's RequestStatus.RUNNING, once the hook is applied


def _alloc_skip_names() -> dict[str, Any]:
    global _RUNNING
    from vllm.v1.request import RequestStatus  # the hook is applied once vLLM is imported

    _RUNNING = RequestStatus.RUNNING
    return {"_pdt_RUNNING": _RUNNING}


def _ids_per_group(blocks: Any) -> list[list[int]]:
    """The block ids of per-group KVCacheBlock lists. (A comprehension: ``b.block_id`` is a
    specialized slot read on CPython 3.11, where ``map(attrgetter("block_id"), ...)`` takes
    the generic attribute path: about a third less time for a request's blocks.)"""
    out = []
    for group in blocks:
        out.append([b.block_id for b in group])
    return out


def _held_ids(kvm: Any, rid: str) -> list[list[int]]:
    """The request's block ids per group right now, read on the caller's thread from the
    coordinator's per-group managers (what ``KVCacheManager.get_block_ids`` returns, without
    building the intermediate KVCacheBlocks object; that method is the fallback)."""
    try:
        managers = kvm.coordinator.single_type_managers
        out = []
        for m in managers:
            out.append([b.block_id for b in m.req_to_blocks.get(rid) or ()])
        return out
    except AttributeError:  # another coordinator layout
        return [list(g) for g in kvm.get_block_ids(rid)]


# --- the allocate_slots bypass ---------------------------------------------------------------

# KV cache spec types whose allocate_slots needs at most ceil((new + lookahead) / block_size)
# new blocks per group for a running request (the blocks it holds cover its computed tokens;
# a sliding window swaps skipped blocks for the null block and keeps the list's length).
_BOUNDED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")


class _Bypass(NamedTuple):
    """What a scheduler needs to bypass its KV cache manager's allocate_slots wrapper."""

    kvm: Any
    inv_block_sizes: float  # sum of 1 / block_size over the KV cache groups
    groups: int
    original: Any  # the unwrapped allocate_slots bound to kvm
    wrapper: Any  # the wrapper bound to kvm


def _bypass_plan(sched: Any, kvm: Any, groups: list) -> _Bypass | None:
    """The plan (kept on the scheduler as ``_pdtrace_bypass``) when the scheduler may skip
    the allocate_slots wrapper on some steps, else None. From here on the manager's
    ``allocate_slots`` instance attribute holds one of the plan's two bound methods: the
    wrapper, or the original during a bypassed schedule() call. (An instance attribute that stays, rather than one
    set and deleted per step: deleting it or swapping the class attribute would cost every
    call site more than the bypass saves. A manager built while hooks were installed keeps
    calling the wrapper it was built with after ``uninstall_all``; with no recorder that
    wrapper only calls the original.)

    On a step where no request waits (``waiting`` and ``kv_holding_waiting`` empty), every
    allocate_slots call comes from schedule()'s running loop: requests in RUNNING status,
    asked for ``num_new_tokens`` (in all at most ``max_num_scheduled_tokens``) plus the
    scheduler's ``num_lookahead_tokens``, without watermark or reserved blocks. The wrapper
    records none of these calls that succeed (``_ALLOC_SKIP``), and one fails only when the
    pool has fewer free blocks than it needs. Summed over the n running requests and the
    groups, they need at most (B + n * (lookahead - 1)) * sum(1 / block_size) + n * groups
    blocks. When the pool holds that many free blocks at the start of the step, no call can
    fail, the step's trace is the same without the wrapper, and ``_schedule_before`` puts
    the unwrapped method on this manager instance for that one schedule() call (about a
    microsecond saved per running request and step). Anything else (a waiting request, a
    tight pool, a spec type outside ``_BOUNDED_SPECS``, hooks not applied) keeps the
    wrapper. Should a preemption still happen inside a bypassed step, the free hook
    reports it as a hook error and restores the wrapper for the rest of the step."""
    fn = getattr(type(kvm), "allocate_slots", None) if kvm is not None else None
    orig = getattr(fn, "__wrapped__", None)
    if orig is None or not getattr(fn, "__pdtrace_hook__", None):
        return None
    if not groups or any(type(g.kv_cache_spec).__name__ not in _BOUNDED_SPECS for g in groups):
        return None
    for attr in ("waiting", "kv_holding_waiting", "running", "max_num_scheduled_tokens", "num_lookahead_tokens"):
        if not hasattr(sched, attr):
            return None
    if not callable(getattr(getattr(kvm, "block_pool", None), "get_num_free_blocks", None)):
        return None
    plan = _Bypass(kvm, sum(1 / int(g.kv_cache_spec.block_size) for g in groups), len(groups),
                   orig.__get__(kvm), fn.__get__(kvm))
    try:  # (no kvm.__dict__ here: reading it would cost every later attribute read on kvm)
        kvm.allocate_slots = plan.wrapper
    except AttributeError:  # __slots__
        return None
    return plan


def _end_bypass(plan: _Bypass) -> None:
    plan.kvm.allocate_slots = plan.wrapper


register("scheduler.allocate_slots", KVM_MOD, "KVCacheManager.allocate_slots",
         ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
          "num_external_computed_tokens", "delay_cache_blocks"),
         after("scheduler.allocate_slots", _alloc_after, skip=_ALLOC_SKIP, skip_names=_alloc_skip_names),
         doc="sched.alloc: blocks per group after the call, lookahead asked for vs the scheduler's")
