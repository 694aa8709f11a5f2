"""NIXL KV connector hooks, vLLM 0.32.0 package ``vllm.distributed.kv_transfer.kv_connector.v1.nixl``.

Scheduler side (engine-core process), on the facade ``connector.NixlBaseConnector`` (it
defines request_finished / request_finished_all_groups / update_state_after_alloc for both
pull and push modes and holds the scheduler's KV cache manager):
- ``request_finished_all_groups`` / ``request_finished`` -> ``nixl.request_finished``
- ``update_state_after_alloc`` (D, do_remote_prefill)     -> ``nixl.remote_alloc``

Worker side (needs a GPU worker in production; tested on the real functions with a
minimal caller, see tests/test_hooks_nixl.py):
- ``base_worker.NixlBaseConnectorWorker._apply_prefix_caching`` -> ``nixl.trim`` (pull: on D; push:
  on P, inside ``push_worker.NixlPushConnectorWorker._xfer_blocks``, which says whose request it is:
  ``mode: "push"``, ``req`` P's request, ``remote_req`` D's)
- ``base_worker.NixlBaseConnectorWorker._apply_prefix_caching_by_region`` -> ``nixl.trim`` with
  ``by_region: true`` (the region-layout path of ``_read_blocks``)
- ``pull_worker.NixlPullConnectorWorker._read_blocks``          -> ``nixl.read``
- ``base_worker.NixlBaseConnectorWorker.get_transfer_results``  -> ``nixl.read_done`` / ``nixl.send_done``
  (push mode's override calls it through ``super()``; ``get_finished`` calls it too).

Older vLLM layouts are other forms of the same hooks (``HookSpec.layouts``): the nixl/ package
before the pull/push split (0.20-0.23), the trim's older signature (0.22-0.25), the inline trim of
``_read_blocks`` observed at its ``_get_block_descs_ids`` calls (0.20-0.21), and the one-file
``nixl_connector.py`` (0.19.x). docs/releases.md lists the target each release takes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from types import SimpleNamespace
from typing import Any

from . import around, register
from .scheduler import _held_ids, inst_for_kv_role, sched_ident, sched_inst, sched_step

PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONN_MOD = PKG + ".connector"
BASE_WORKER_MOD = PKG + ".base_worker"
PULL_WORKER_MOD = PKG + ".pull_worker"
PUSH_WORKER_MOD = PKG + ".push_worker"
OLD_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector"
# vLLM 0.20.0-0.23.0: the nixl/ package before the pull/push split (one NixlConnector, one worker class)
MID_WORKER_MOD = PKG + ".worker"
MID = "0.20.0-0.23.0 (nixl/ package before the pull/push split)"
INLINE = "0.20.0-0.21.x (the trim is inline in _read_blocks)"
OLD = "0.19.x and earlier (one file, nixl_connector.py; the trim inline in _read_blocks)"


def _groups(ids: Any) -> list[list[int]]:
    """BlockIds (tuple/list of per-group lists, or one flat list) -> list[list[int]]."""
    if ids is None:
        return []
    ids = list(ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        return [[int(x) for x in ids]]
    return [[int(x) for x in g] for g in ids]


def _conn_where(conn: Any, rec: Any) -> tuple[str, int | None]:
    sched = getattr(conn, "_pdtrace_sched", None)
    if sched is not None:
        return sched_inst(sched), sched_step(sched)
    ktc = getattr(conn, "kv_transfer_config", None) or getattr(conn, "_kv_transfer_config", None)
    if ktc is not None:
        return inst_for_kv_role(getattr(ktc, "kv_role", None)), None
    return rec.inst, None


def _conn_ident(conn: Any, fields: dict, rnt: Any = None) -> dict:
    """Adds ``sched`` / ``engine`` (the connector's scheduler and engine id) and, when the
    params said it, ``remote_num_tokens`` to ``fields`` (absent stays absent, never 0)."""
    if rnt is not None:
        fields["remote_num_tokens"] = int(rnt)
    sched = getattr(conn, "_pdtrace_sched", None)
    sid, engine = sched_ident(sched) if sched is not None else (None, None)
    if engine is None:
        engine = getattr(conn, "engine_id", None)
    if sid is not None:
        fields["sched"] = sid
    if engine is not None:
        fields["engine"] = str(engine)
    return fields


def _worker_where(worker: Any, rec: Any) -> str:
    return getattr(worker, "_pdtrace_inst", None) or rec.inst


# --- request_finished (P: what it reports to D) ---------------------------------------------

# Inlined into the generated wrappers: a request without kv_transfer_params (plain serving
# through a connector-enabled scheduler) calls just the original. The before-functions
# apply the same test themselves (the generic wrapper ignores ``skip``).
_NO_TRANSFER = "not request.kv_transfer_params"


def _rf_before(rec: Any, self: Any, request: Any, block_ids: Any, *a: Any, **kw: Any) -> dict:
    params = request.kv_transfer_params
    if not params:
        return None  # no P/D transfer for this request: the connector does nothing with it
    # allocated_block_ids: everything the request holds on this instance, lookahead blocks
    # included. The scheduler's KV cache manager (bound to the connector by
    # Scheduler.__init__ via bind_kv_cache_manager) knows it; blocks are not freed yet at
    # this point (the scheduler frees after request_finished returns). Without a bound
    # manager (older layouts, bare connectors) the connector's own view is the block ids
    # the scheduler passed in, which may already be clipped to the computed tokens.
    kvm = getattr(self, "_kv_cache_manager", None)
    if kvm is not None:
        allocated = _held_ids(kvm, request.request_id)
        src = "kv_cache_manager"
    else:
        allocated = _groups(block_ids)
        src = "connector"
    return {
        "side": "P" if params.get("do_remote_decode") else "D",
        "allocated": allocated,
        "src": src,
        "arg": _groups(block_ids),
    }


def _rf_after(rec: Any, st: Any, result: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    if st is None or result is None:
        return
    delay_free, params = result
    params = params or {}
    inst, step = _conn_where(self, rec)
    rec.put("nixl.request_finished", request.request_id, step, _conn_ident(self, {
        "inst": inst,
        "side": st["side"],
        "allocated_block_ids": st["allocated"],
        "arg_block_ids": st["arg"],
        "block_ids": _groups(params.get("remote_block_ids")),
        "num_computed_tokens": int(request.num_computed_tokens),
        "prompt_len": int(request.num_prompt_tokens),
        "delay_free": bool(delay_free),
        "allocated_from": st["src"],
    }, params.get("remote_num_tokens")))


register("nixl.request_finished", CONN_MOD, "NixlBaseConnector.request_finished_all_groups",
         ("request", "block_ids"),
         around("nixl.request_finished", _rf_before, _rf_after, skip=_NO_TRANSFER),
         layouts=((CONN_MOD, "NixlConnector.request_finished_all_groups", ("request", "block_ids"), MID),
                  (OLD_MOD, "NixlConnector.request_finished_all_groups", ("request", "block_ids"), OLD)),
         doc="nixl.request_finished (HMA path, all KV cache groups)")
register("nixl.request_finished_1g", CONN_MOD, "NixlBaseConnector.request_finished",
         ("request", "block_ids"),
         around("nixl.request_finished_1g", _rf_before, _rf_after, skip=_NO_TRANSFER),
         layouts=((CONN_MOD, "NixlConnector.request_finished", ("request", "block_ids"), MID),
                  (OLD_MOD, "NixlConnector.request_finished", ("request", "block_ids"), OLD)),
         doc="nixl.request_finished (single-group path)")


# --- update_state_after_alloc (D) --------------------------------------------------------------

def _usa_before(rec: Any, self: Any, request: Any, blocks: Any, num_external_tokens: int,
                *a: Any, **kw: Any) -> dict | None:
    params = request.kv_transfer_params
    if not params or not params.get("do_remote_prefill"):
        return None  # only the first (transfer-planning) call on D is of interest
    return {
        "local": _groups(blocks.get_block_ids()) if hasattr(blocks, "get_block_ids") else _groups(blocks),
        "remote": _groups(params.get("remote_block_ids")),
        "rnt": params.get("remote_num_tokens"),
        "rreq": params.get("remote_request_id"),
        "reng": params.get("remote_engine_id"),
        "n_ext": int(num_external_tokens),
    }


def _usa_after(rec: Any, st: Any, result: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    if not st:
        return
    inst, step = _conn_where(self, rec)
    fields: dict[str, Any] = {}
    if st["rnt"] is not None:
        fields["remote_num_tokens"] = int(st["rnt"])
    if st["rreq"] is not None:
        fields["remote_req"] = str(st["rreq"])
    if st["reng"] is not None:
        fields["remote_engine"] = str(st["reng"])
    _conn_ident(self, fields)
    load = _load_list(self, request.request_id)
    if load is not None:
        fields["load_block_ids"] = load
    rec.emit("nixl.remote_alloc", req=request.request_id, step=step, inst=inst,
             local_block_ids=st["local"], remote_block_ids=st["remote"],
             num_external_tokens=st["n_ext"], **fields)


def _load_list(conn: Any, req_id: Any) -> list[list[int]] | None:
    """The blocks D's connector scheduler just planned to load for ``req_id`` (its
    ``_reqs_need_recv`` entry: (request, local_block_ids, ...)), as the connector derived them
    from D's list: the release's own rule, so nothing here re-implements it. None where the
    release keeps it otherwise."""
    cs = getattr(conn, "connector_scheduler", None) or conn
    entry = (getattr(cs, "_reqs_need_recv", None) or {}).get(req_id)
    if not isinstance(entry, tuple) or len(entry) < 2:
        return None
    try:
        return _groups(entry[1])
    except (TypeError, ValueError):
        return None


register("nixl.remote_alloc", CONN_MOD, "NixlBaseConnector.update_state_after_alloc",
         ("request", "blocks", "num_external_tokens"),
         around("nixl.remote_alloc", _usa_before, _usa_after, skip=_NO_TRANSFER),
         layouts=((CONN_MOD, "NixlConnector.update_state_after_alloc", ("request", "blocks", "num_external_tokens"),
                   MID),
                  (OLD_MOD, "NixlConnector.update_state_after_alloc", ("request", "blocks", "num_external_tokens"),
                   OLD)),
         doc="nixl.remote_alloc: D's local blocks vs P's reported blocks")


# --- _apply_prefix_caching (D worker) ------------------------------------------------------------

def _trim_after(rec: Any, st: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if st is None:
        return
    extra: dict[str, Any] = {}
    if result is None:  # the trim raised (the wrapper calls this from its except block)
        exc = sys.exc_info()[1]
        if exc is None:
            return
        # vLLM #50558: D holds more blocks to load than P reported; the trim asserts on it
        extra["raised"] = (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]
        result = ([[] for _ in st[0]], [[] for _ in st[1]])
    local_out, remote_out = _groups(result[0]), _groups(result[1])
    self._pdtrace_last_trim = (local_out, remote_out)
    push = getattr(self, "_pdtrace_push", None)
    if push is not None:  # inside push mode's _xfer_blocks, on P: decode = D's blocks, prefill = P's
        extra = {"mode": "push", "remote_req": push}
    if st[2]:
        extra["by_region"] = True
    req = getattr(self, "_pdtrace_cur_req", None) or getattr(self, "_pdtrace_region_req", None)
    rec.emit("nixl.trim", req=req, inst=_worker_where(self, rec),
             local_in=st[0], remote_in=st[1], local_out=local_out, remote_out=remote_out,
             mamba=bool(getattr(self, "_has_mamba", False)), **extra)


def _trim_before(by_region: bool):
    """The ``before`` half of both trims: the block lists going in, and which trim it is."""
    def before(rec: Any, self: Any, decode_block_ids: Any, prefill_block_ids: Any, *a: Any, **kw: Any) -> tuple:
        return _groups(decode_block_ids), _groups(prefill_block_ids), by_region

    return before


_trim_plain_before, _trim_region_before = _trim_before(False), _trim_before(True)


def _descs_before(rec: Any, self: Any, engine_id: str, block_ids: Any, *a: Any, **kw: Any) -> Any:
    if getattr(self, "_pdtrace_read_in", None) is None:
        return None  # not inside _read_blocks (registration, other callers)
    return engine_id, _groups(block_ids)


def _descs_after(rec: Any, st: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if st is None or result is None:
        return
    engine_id, blocks = st
    if engine_id != getattr(self, "engine_id", None):
        self._pdtrace_descs_remote = blocks  # the remote list, trimmed
        return
    remote = getattr(self, "_pdtrace_descs_remote", None)
    local_in, remote_in = self._pdtrace_read_in
    if remote is None:
        return
    self._pdtrace_descs_remote = None
    self._pdtrace_last_trim = (blocks, remote)
    rec.emit("nixl.trim", req=getattr(self, "_pdtrace_cur_req", None), inst=_worker_where(self, rec),
             local_in=local_in, remote_in=remote_in, local_out=blocks, remote_out=remote,
             mamba=bool(getattr(self, "_has_mamba", False)), inline=True)


register("nixl.trim", BASE_WORKER_MOD, "NixlBaseConnectorWorker._apply_prefix_caching",
         ("decode_block_ids", "prefill_block_ids", "decode_physical_per_logical", "prefill_physical_per_logical"),
         around("nixl.trim", _trim_plain_before, _trim_after),
         # before 0.26 the trim took (local_block_ids, remote_block_ids, remote_physical_per_logical): the
         # same two lists first (D's blocks, P's blocks), so the same before/after halves read them
         layouts=((BASE_WORKER_MOD, "NixlBaseConnectorWorker._apply_prefix_caching",
                   ("local_block_ids", "remote_block_ids"), "0.24.0-0.25.x"),
                  (MID_WORKER_MOD, "NixlConnectorWorker._apply_prefix_caching",
                   ("local_block_ids", "remote_block_ids"), "0.22.0-0.23.0 (the method appears in 0.22.0)"),
                  (MID_WORKER_MOD, "NixlConnectorWorker._get_block_descs_ids", ("engine_id", "block_ids"),
                   INLINE + ": the trimmed lists reach the descriptor ids", around("nixl.trim", _descs_before,
                                                                                   _descs_after)),
                  (OLD_MOD, "NixlConnectorWorker._get_block_descs_ids", ("engine_id", "block_ids"),
                   OLD, around("nixl.trim", _descs_before, _descs_after))),
         doc="nixl.trim: which local/remote blocks pair up after prefix-cache trimming")
register("nixl.trim_by_region", BASE_WORKER_MOD, "NixlBaseConnectorWorker._apply_prefix_caching_by_region",
         ("decode_block_ids", "prefill_block_ids"),
         around("nixl.trim_by_region", _trim_region_before, _trim_after), optional=True,
         doc="nixl.trim (by_region): the region-layout trim of _read_blocks (vLLM >= 0.32)")


# _read_blocks_for_req (D, pull) runs the region trim before _read_blocks: it says whose request it is
def _rfr_before(rec: Any, self: Any, req_id: str, meta: Any, *a: Any, **kw: Any) -> bool:
    self._pdtrace_region_req = req_id
    return True


def _rfr_after(rec: Any, st: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    self._pdtrace_region_req = None


register("nixl.read_for_req", PULL_WORKER_MOD, "NixlPullConnectorWorker._read_blocks_for_req", ("req_id", "meta"),
         around("nixl.read_for_req", _rfr_before, _rfr_after), optional=True,
         doc="pull mode: the request whose region-layout trim (by_region) runs inside")


# --- _xfer_blocks (P worker, push mode): whose request the trim inside it is -------------------

def _push_before(rec: Any, self: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                 remote_request_id: str, *a: Any, **kw: Any) -> bool:
    self._pdtrace_cur_req = request_id
    self._pdtrace_push = str(remote_request_id)
    return True


def _push_after(rec: Any, st: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    self._pdtrace_cur_req = None
    self._pdtrace_push = None


register("nixl.push_xfer", PUSH_WORKER_MOD, "NixlPushConnectorWorker._xfer_blocks",
         ("read_spec", "dst_engine_id", "request_id", "remote_request_id"),
         around("nixl.push_xfer", _push_before, _push_after), optional=True,
         doc="push mode (P writes into D): the nixl.trim inside carries P's request and D's (remote_req)")


# --- _read_blocks (D worker, pull mode) -------------------------------------------------------------

def _read_before(rec: Any, self: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                 remote_request_id: str, *a: Any, **kw: Any) -> dict:
    self._pdtrace_cur_req = request_id
    self._pdtrace_last_trim = None
    handles = getattr(self, "_recving_transfers", {}).get(request_id) or ()
    return {"n": len(handles), "spec": read_spec, "eng": dst_engine_id, "rreq": remote_request_id,
            "t": time.monotonic_ns()}


def _read_after(rec: Any, st: Any, ok: Any, self: Any, read_spec: Any, dst_engine_id: str, request_id: str,
                *a: Any, **kw: Any) -> None:
    self._pdtrace_cur_req = None
    if st is None:
        return
    trimmed = getattr(self, "_pdtrace_last_trim", None)
    if trimmed is not None:
        local, remote = trimmed
    else:  # no trim ran (DCP / region path): the spec's lists are what was read
        local, remote = _groups(read_spec.local_block_ids), _groups(read_spec.remote_block_ids)
    if not any(local):
        return  # full local prefix hit: notification only, nothing read
    new = list((getattr(self, "_recving_transfers", {}).get(request_id) or ())[st["n"]:])
    issued = getattr(self, "_pdtrace_issue", None)
    if issued is None:
        issued = self._pdtrace_issue = {}
    issued[request_id] = st["t"]
    # bytes: blocks x bytes per block summed over the registered KV regions, when the
    # worker exposes its per-layer block lengths; 0 when it does not (unknown).
    per_block = sum(getattr(self, "block_len_per_layer", None) or ())
    nbytes = int(per_block) * sum(len(g) for g in local) if per_block else 0
    rec.emit("nixl.read", req=request_id, inst=_worker_where(self, rec),
             local_block_ids=local, remote_block_ids=remote, bytes=nbytes,
             handle=",".join(repr(h) for h in new) if new else ("posted" if ok else "failed"),
             remote_engine=str(st["eng"]), remote_req=str(st["rreq"]))


# vLLM 0.20.0-0.21.x: _read_blocks(local_block_ids, remote_block_ids, dst_engine_id, request_id,
# remote_request_id, ...) trims inline (no _apply_prefix_caching yet); the trimmed lists are what it
# hands _get_block_descs_ids, remote first (dst_engine_id), then local (its own engine id).


def _read_before_inline(rec: Any, self: Any, local_block_ids: Any, remote_block_ids: Any, dst_engine_id: str,
                        request_id: str, remote_request_id: str, *a: Any, **kw: Any) -> dict:
    spec = SimpleNamespace(local_block_ids=local_block_ids, remote_block_ids=remote_block_ids)
    self._pdtrace_read_in = (_groups(local_block_ids), _groups(remote_block_ids))
    self._pdtrace_descs_remote = None
    return _read_before(rec, self, spec, dst_engine_id, request_id, remote_request_id)


def _read_after_inline(rec: Any, st: Any, ok: Any, self: Any, local_block_ids: Any, remote_block_ids: Any,
                       dst_engine_id: str, request_id: str, *a: Any, **kw: Any) -> None:
    self._pdtrace_read_in = None
    spec = st["spec"] if st else None
    _read_after(rec, st, ok, self, spec, dst_engine_id, request_id)


register("nixl.read", PULL_WORKER_MOD, "NixlPullConnectorWorker._read_blocks",
         ("read_spec", "dst_engine_id", "request_id", "remote_request_id"),
         around("nixl.read", _read_before, _read_after),
         layouts=((MID_WORKER_MOD, "NixlConnectorWorker._read_blocks",
                   ("read_spec", "dst_engine_id", "request_id", "remote_request_id"), MID),
                  (MID_WORKER_MOD, "NixlConnectorWorker._read_blocks",
                   ("local_block_ids", "remote_block_ids", "dst_engine_id", "request_id", "remote_request_id"),
                   INLINE, around("nixl.read", _read_before_inline, _read_after_inline)),
                  (OLD_MOD, "NixlConnectorWorker._read_blocks",
                   ("local_block_ids", "remote_block_ids", "dst_engine_id", "request_id", "remote_request_id"),
                   OLD, around("nixl.read", _read_before_inline, _read_after_inline))),
         doc="nixl.read: a READ was posted (local <- remote pairs after trimming)")


# --- get_transfer_results (completion, both sides) ---------------------------------------------------

@dataclasses.dataclass
class _Finished:
    finished_sending: Any = None
    finished_recving: Any = None
    failed_recving: Any = None  # get_finished() reports failed loads through get_block_ids_with_load_errors


def _tr_before(rec: Any, self: Any, *a: Any, **kw: Any) -> None:
    return None


def _tr_after(rec: Any, _st: Any, res: Any, self: Any, *a: Any, **kw: Any) -> None:
    if res is None:
        return
    if isinstance(res, tuple) and len(res) == 2:  # get_finished() (before 0.26): (done_sending, done_recving)
        res = _Finished(finished_sending=res[0], finished_recving=res[1])
    inst = _worker_where(self, rec)
    now = time.monotonic_ns()
    issued = getattr(self, "_pdtrace_issue", None) or {}
    for rid in getattr(res, "finished_recving", None) or ():
        t0 = issued.pop(rid, None)
        extra = {"dur_ns": now - t0} if t0 is not None else {}
        rec.emit("nixl.read_done", req=rid, inst=inst, status="DONE", **extra)
    for rid in getattr(res, "failed_recving", None) or ():
        t0 = issued.pop(rid, None)
        extra = {"dur_ns": now - t0} if t0 is not None else {}
        rec.emit("nixl.read_done", req=rid, inst=inst, status="ERR", **extra)
    seen = getattr(self, "_pdtrace_sent", None)  # (inside push mode's override: what it adds later)
    for rid in getattr(res, "finished_sending", None) or ():
        rec.emit("nixl.send_done", req=rid, inst=inst)
        if seen is not None:
            seen.add(rid)


register("nixl.transfer_results", BASE_WORKER_MOD, "NixlBaseConnectorWorker.get_transfer_results", (),
         around("nixl.transfer_results", _tr_before, _tr_after),
         layouts=((BASE_WORKER_MOD, "NixlBaseConnectorWorker.get_finished", (), "0.24.0-0.25.x"),
                  (MID_WORKER_MOD, "NixlConnectorWorker.get_finished", (), MID),
                  (OLD_MOD, "NixlConnectorWorker.get_finished", (), OLD)),
         doc="nixl.read_done (D) and nixl.send_done (P)")
from . import nixl_lease  # noqa: E402,F401  (P's lease expiry: its own module)
