"""P's KV lease running out (issue 51, kv-never-crossed's expired-lease rule): the NIXL worker on P
holds a request's blocks for D's read under a lease (``kv_lease_duration``, 30 s by default, extended
by D's heartbeats for requests D already holds) and releases them when it runs out
(``base_worker.NixlBaseConnectorWorker._reap_expired_send_leases``, vLLM 0.32+: it adds the request
to ``done_sending``, so the scheduler frees its blocks and hands them to other requests). A D that
reads them later gets whatever they hold then; vLLM only logs "Potentially invalid KV blocks for
unrecognized request" on P and D serves the tokens.

- ``_reap_expired_send_leases(done_sending)`` -> ``nixl.lease_expired`` per request it released:
  P's request id, the notifications it had counted (``retrieved``), P's engine id.

- push mode (``push_worker.NixlPushConnectorWorker.get_transfer_results``) -> ``nixl.send_done`` for each
  request whose WRITE into D completed: the override adds them to ``finished_sending`` after the hooked
  base method has returned, so without this hook a push trace never says P's send ended.

Before 0.32 the expiry is inline in ``get_finished`` / ``get_transfer_results``: not recorded there
(the hook is optional; ``check`` says the rule was not checked where the trace has no lease event
kind recorded)."""

from __future__ import annotations

from typing import Any

from . import around, register

BASE_WORKER_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
PUSH_WORKER_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker"


def _before(rec: Any, self: Any, done_sending: Any, *a: Any, **kw: Any) -> Any:
    held = getattr(self, "_reqs_to_send", None)
    if not held:
        return None  # (nothing leased: nothing can expire; the common case costs one attribute read)
    counts = getattr(self, "consumer_notification_counts_by_req", None) or {}
    return set(done_sending), {rid: int(counts.get(rid, 0)) for rid in held}


def _after(rec: Any, st: Any, _res: Any, self: Any, done_sending: Any, *a: Any, **kw: Any) -> None:
    if st is None:
        return
    before, counts = st
    inst = getattr(self, "_pdtrace_inst", None) or rec.inst
    engine = getattr(self, "engine_id", None)
    for rid in set(done_sending) - before:
        rec.emit("nixl.lease_expired", req=str(rid), inst=inst, retrieved=counts.get(rid, 0),
                 **({"engine": str(engine)} if engine is not None else {}))


register("nixl.lease_expired", BASE_WORKER_MOD, "NixlBaseConnectorWorker._reap_expired_send_leases", ("done_sending",),
         around("nixl.lease_expired", _before, _after), optional=True,
         doc="nixl.lease_expired (P: a request's blocks released because no D read them before the lease ran out; 0.32+)")


def _push_before(rec: Any, self: Any, *a: Any, **kw: Any) -> Any:
    self._pdtrace_sent = set()  # the base method's hook notes the send_done it recorded
    return True


def _push_after(rec: Any, st: Any, res: Any, self: Any, *a: Any, **kw: Any) -> None:
    seen, self._pdtrace_sent = getattr(self, "_pdtrace_sent", None) or set(), None
    if res is None:
        return
    inst = getattr(self, "_pdtrace_inst", None) or rec.inst
    for rid in getattr(res, "finished_sending", None) or ():
        if rid not in seen:  # a push whose WRITE completed (the lease's own ends the base hook recorded)
            rec.emit("nixl.send_done", req=str(rid), inst=inst, mode="push")


register("nixl.push_send_done", PUSH_WORKER_MOD, "NixlPushConnectorWorker.get_transfer_results", (),
         around("nixl.push_send_done", _push_before, _push_after), optional=True,
         doc="nixl.send_done (P, push mode: the WRITE into D's blocks completed; 0.32+)")
