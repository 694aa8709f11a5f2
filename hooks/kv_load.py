"""KV load failure hooks: what failed to load, and what the scheduler did about it (issue 36).

Scheduler side (engine-core process), ``vllm.v1.core.sched.scheduler.Scheduler``:
- ``_handle_failed_recving(failed_req_ids)`` (0.30+: whole requests whose receive failed) and
  ``_handle_invalid_blocks(invalid_block_ids, num_scheduled_tokens)`` (0.19+: blocks whose load
  failed) -> one ``kvload.handled`` (the policy, what was reported, the requests the scheduler
  fails) and one ``kvload.request`` per request the call changed: its ``num_computed_tokens`` and
  ``num_output_placeholders`` before and after, its blocks, and the action taken.
  Both are called from ``update_from_output`` only when the worker reported a failure, so the
  hooks cost nothing on a healthy run. The requests looked at are the scheduler's own
  ``running`` and those waiting on a remote load (``kv_holding_waiting``; ``skipped_waiting``
  in 0.19), read before and after the call; the arguments pass through untouched.

- ``update_from_output(scheduler_output, ...)`` -> ``sched.output`` (the step whose output the scheduler just
  processed: a step scheduled before it was in flight until then; the KV model's in-flight writes, vLLM #37285),
  and, while a request rolled back by the above is followed, ``kvload.output``: what one step's output
  appended to that request, and whether the step was scheduled before the rollback.

Worker side (D's NIXL worker; a GPU worker in production):
- ``NixlBaseConnectorWorker._log_failure`` (every failed handshake, transfer, notification,
  logged with its type, request and exception) -> ``kvload.error``
- ``NixlBaseConnectorWorker.get_block_ids_with_load_errors`` (the blocks handed to the
  scheduler as ``invalid_block_ids``) -> ``kvload.reported`` when not empty.
Older layouts as in hooks/nixl.py: nixl/worker.py (0.20-0.23), nixl_connector.py (0.19).
"""

from __future__ import annotations

import sys
from typing import Any

from . import after, around, before, register
from .nixl import BASE_WORKER_MOD, MID, MID_WORKER_MOD, OLD, OLD_MOD
from .scheduler import SCHED_MOD, _held_ids, sched_inst, sched_step


def _policy(sched: Any) -> str:
    return "recompute" if getattr(sched, "recompute_kv_load_failures", False) else "fail"


def _status(req: Any) -> str:
    st = req.status
    return getattr(st, "_name_", None) or str(st)


def _looked_at(sched: Any) -> list[Any]:
    """The requests a failure can touch: running, and those waiting on a remote load (in
    ``kv_holding_waiting``, 0.2x+; ``skipped_waiting``, 0.19; ``waiting`` before either)."""
    out = list(getattr(sched, "running", ()) or ())
    for name in ("kv_holding_waiting", "skipped_waiting", "waiting"):
        q = getattr(sched, name, None)
        if q is not None:
            out.extend(r for r in list(q) if _status(r) == "WAITING_FOR_REMOTE_KVS")
    return out


def _snapshot(sched: Any) -> dict[str, tuple]:
    return {r.request_id: (r, r.num_computed_tokens, getattr(r, "num_output_placeholders", 0), _status(r),
                           _held_ids(sched.kv_cache_manager, r.request_id))
            for r in _looked_at(sched)}


def _after(rec: Any, source: str, sched: Any, snap: dict, result: Any, fields: dict) -> None:
    """``result``: what the handler returned to ``update_from_output``: the requests to fail
    under "fail"; under "recompute", the running requests it rescheduled (skipped this step)."""
    step, inst, policy = sched_step(sched), sched_inst(sched), _policy(sched)
    returned = sorted(result or ())
    failed = returned if policy == "fail" else []
    if policy != "fail" and returned:
        fields["rescheduled"] = returned
    retry = getattr(sched, "failed_recving_kv_req_ids", None) or set()
    rec.put("kvload.handled", None, step, {
        "inst": inst, "source": source, "policy": policy, "groups": len(sched.kv_cache_config.kv_cache_groups),
        "failed": failed, **fields})
    for rid, (req, computed, ph, status, blocks) in snap.items():
        now_ph = getattr(req, "num_output_placeholders", 0)
        changed = req.num_computed_tokens != computed or now_ph != ph
        if not changed and rid not in failed and rid not in retry:
            continue
        action = ("fail" if rid in failed else
                  "recompute" if req.num_computed_tokens < computed or rid in returned else "none")
        if action == "recompute":  # follow what update_from_output appends to it next (_output_after)
            follow = getattr(sched, "_pdtrace_rolled", None)
            if follow is None:
                follow = sched._pdtrace_rolled = {}
            follow[rid] = [step, req, len(req.output_token_ids), 0]
        rec.put("kvload.request", rid, step, {
            "inst": inst, "source": source, "policy": policy, "status": status,
            "computed_before": computed, "computed": req.num_computed_tokens,
            "placeholders_before": ph, "placeholders": now_ph, "num_tokens": req.num_tokens,
            "block_ids": blocks, "action": action, "retry": rid in retry})


def _invalid_before(rec: Any, self: Any, invalid_block_ids: Any, num_scheduled_tokens: Any, *a: Any,
                    **kw: Any) -> tuple:
    return _snapshot(self), sorted(int(b) for b in invalid_block_ids or ())


def _invalid_after(rec: Any, state: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if state is None:
        return
    snap, ids = state
    fields: dict[str, Any] = {"block_ids": ids}
    if result is None:  # the handler raised (the wrapper calls this from its except block)
        exc = sys.exc_info()[1]
        # vLLM 0.2x: ValueError unpacking a multi-group block list (#50687); 0.32+: RuntimeError, block-level
        # failures of multi-group models refused (#56855)
        fields["error"] = (f"{type(exc).__name__}: {exc}"[:300] if exc is not None else "raised (see the engine's log)")
    _after(rec, "invalid_blocks", self, snap, result, fields)


register("kv_load.invalid_blocks", SCHED_MOD, "Scheduler._handle_invalid_blocks",
         ("invalid_block_ids", "num_scheduled_tokens"), around("kv_load.invalid_blocks", _invalid_before, _invalid_after),
         doc="kvload.handled / kvload.request (blocks whose load failed; the scheduler's decision)")


def _recv_before(rec: Any, self: Any, failed_req_ids: Any, *a: Any, **kw: Any) -> tuple:
    return _snapshot(self), sorted(str(r) for r in failed_req_ids or ())


def _recv_after(rec: Any, state: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if state is None:
        return
    snap, reqs = state
    _after(rec, "failed_recving", self, snap, result, {"reqs": reqs})


register("kv_load.failed_recving", SCHED_MOD, "Scheduler._handle_failed_recving", ("failed_req_ids",),
         around("kv_load.failed_recving", _recv_before, _recv_after), optional=True,
         doc="kvload.handled / kvload.request (whole requests whose receive failed; vLLM 0.30+)")


def _output_after(rec: Any, _result: Any, self: Any, scheduler_output: Any, *a: Any, **kw: Any) -> None:
    """``kvload.output``: for a request a rollback cut back, what ``update_from_output`` appended
    to its output from one step's output, and which step that was: a step scheduled before the
    rollback (in flight when the failure was handled, under async scheduling) ran on the KV that
    failed to load. Followed until the output of a step scheduled after the rollback (or the
    request's end); ``_pdtrace_outs`` (hooks/scheduler.py) maps the SchedulerOutput to its step."""
    sid = id(scheduler_output)
    out_step = next((s for i, s in reversed(getattr(self, "_pdtrace_outs", ())) if i == sid), None)
    if out_step is not None and scheduler_output.total_num_scheduled_tokens:  # (an empty step writes nothing)
        rec.put("sched.output", None, out_step, {"inst": sched_inst(self)})
    follow = getattr(self, "_pdtrace_rolled", None)
    if not follow:
        return
    scheduled = scheduler_output.num_scheduled_tokens
    for rid, f in list(follow.items()):
        rstep, req, n_before, seen = f
        if rid not in scheduled:
            if rid not in self.requests or req.is_finished():
                del follow[rid]
            continue
        n_now = len(req.output_token_ids)
        rec.put("kvload.output", rid, out_step, {
            "inst": sched_inst(self), "rollback_step": rstep, "position": n_before, "appended": n_now - n_before,
            "computed": req.num_computed_tokens, "in_flight": out_step is not None and out_step <= rstep})
        f[2], f[3] = n_now, seen + 1
        if out_step is None or out_step > rstep or seen >= 3 or req.is_finished():
            del follow[rid]


register("kv_load.output", SCHED_MOD, "Scheduler.update_from_output", ("scheduler_output",),
         after("kv_load.output", _output_after),
         doc="sched.output (the step whose output was processed: in flight until then) and kvload.output "
             "(after a rollback: the tokens a step's output appended, and whether that step was in flight at the "
             "rollback)")


# --- worker side ------------------------------------------------------------------------------

def _error_before(rec: Any, self: Any, failure_type: str, req_id: Any = None, msg: str = "", error: Any = None,
                  meta: Any = None, **kw: Any) -> None:
    remote = getattr(meta, "remote", None)
    fields: dict[str, Any] = {"failure": str(failure_type), "engine": str(getattr(self, "engine_id", "") or "")}
    if error is not None:
        fields["error"] = f"{type(error).__name__}: {error}"[:300]
    if msg:
        fields["detail"] = str(msg)[:300]
    if remote is not None:
        fields["remote_req"] = str(getattr(remote, "request_id", "") or "")
        fields["remote_engine"] = str(getattr(remote, "engine_id", "") or "")
    rec.put("kvload.error", None if req_id is None else str(req_id), None, fields)


_W_LAYOUTS = ((MID_WORKER_MOD, "NixlConnectorWorker.{}", MID), (OLD_MOD, "NixlConnectorWorker.{}", OLD))

register("kv_load.error", BASE_WORKER_MOD, "NixlBaseConnectorWorker._log_failure", ("failure_type", "req_id"),
         before("kv_load.error", _error_before),
         layouts=tuple((m, q.format("_log_failure"), ("failure_type", "req_id"), r) for m, q, r in _W_LAYOUTS),
         doc="kvload.error (a failed NIXL handshake / transfer / notification, as the worker logs it)")


def _reported_after(rec: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    rec.put("kvload.reported", None, None, {"block_ids": sorted(int(b) for b in result)})


register("kv_load.reported", BASE_WORKER_MOD, "NixlBaseConnectorWorker.get_block_ids_with_load_errors", (),
         after("kv_load.reported", _reported_after, skip="not _pdt_result"),
         layouts=tuple((m, q.format("get_block_ids_with_load_errors"), (), r) for m, q, r in _W_LAYOUTS),
         doc="kvload.reported (the block ids the worker hands the scheduler as invalid_block_ids)")
