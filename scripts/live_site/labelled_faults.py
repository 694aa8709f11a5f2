"""Labelled faults for live CPU test servers (test harness only; sitecustomize.py in this directory arms them
from ``PDTRACE_LABELLED_FAULT``, which scripts/live_servers.py sets for one server of a pair). Each fault is an
old vLLM rule or a deliberate corruption put on the real code path of ``vllm serve``, and says so in the trace
with a ``fault.inject`` event (``sim`` false: it ran in the live server), so a test can hold pdtrace's findings
to the fault's own record. Never used outside the live tests; nothing in pdtrace imports this.

``p-sends-full-allocation`` (P): the rule before vLLM #44151's fix. 0.32.0's ``Scheduler._connector_finished``
  hands the connector ``kv_cache_manager.get_block_ids_for_computed_tokens(request_id=..., num_computed_tokens=...)``;
  before the fix it was ``get_block_ids(request_id)``, the whole allocation with the spec-decode lookahead blocks.
  D's ``_apply_prefix_caching`` keeps ``remote[-n:]``: a prompt whose lookahead spills a block is read shifted.
  (The same rule as ``pdtrace.testing.pd_faults.old_p_block_rule``, which the engine-core harness applies.)
``d-corrupts-landed-block:K`` (D): the K-th request whose NIXL read lands (counting from 1, warm-ups included),
  one byte of its first loaded block of KV cache group 0 is flipped in every layer of that group after the read
  landed and before the request's first forward: ``NixlBaseConnectorWorker.get_transfer_results`` (0.32.0).
"""

from __future__ import annotations

import os
import sys

ENV = "PDTRACE_LABELLED_FAULT"
_TARGETS = {
    "p-sends-full-allocation": ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_block_ids_for_computed_tokens"),
    "d-corrupts-landed-block": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
                                "NixlBaseConnectorWorker", "get_transfer_results"),
}


def _emit(**kw) -> None:
    try:
        from pdtrace.record import recorder

        rec = recorder.get()
        if rec is not None:
            rec.emit("fault.inject", sim=False, **kw)
    except Exception as exc:  # never stop the server
        sys.stderr.write(f"labelled_faults: fault.inject not recorded: {exc}\n")


def _full_allocation(cls) -> None:
    def get_block_ids_for_computed_tokens(self, request_id, num_computed_tokens):  # noqa: ARG001
        return self.get_block_ids(request_id)

    cls.get_block_ids_for_computed_tokens = get_block_ids_for_computed_tokens
    _emit(rule="p-sends-full-allocation",
          detail="Scheduler._connector_finished: kv_cache_manager.get_block_ids_for_computed_tokens -> "
                 "get_block_ids (pre-#44151 rule: P reports its lookahead blocks beyond its computed tokens)")


def _corrupt_landed(cls, k: int) -> None:
    orig = cls.get_transfer_results
    seen = [0]

    def get_transfer_results(self):
        metas = {rid: m.local_block_ids for rid, m in getattr(self, "_recving_metadata", {}).items()}
        res = orig(self)
        for rid in sorted(getattr(res, "finished_recving", None) or ()):
            ids = metas.get(rid)
            g0 = [b for b in (ids[0] if ids else ()) if b]
            if not g0:
                continue
            seen[0] += 1
            if seen[0] != k:
                continue
            _flip(rid, g0[0])
        return res

    cls.get_transfer_results = get_transfer_results


def _flip(rid: str, block: int) -> None:
    try:
        import torch

        from pdtrace.hooks import kv_digest

        layers = [c for g, _n, c in kv_digest._STATE.get("layers") or () if g == 0]
        for cache in layers:  # the first byte of the block's region in each layer of group 0
            u = cache[block].view(-1).view(torch.uint8)
            u[0] = u[0] ^ 0xFF
        _emit(rule="d-corrupts-landed-block", req=str(rid), group=0, block=int(block), index=0, layers=len(layers),
              detail=f"flipped the first byte of block {block} (group 0, the request's first loaded block) in "
                     f"{len(layers)} layer(s) after its NIXL read landed, before its first forward")
    except Exception as exc:
        sys.stderr.write(f"labelled_faults: d-corrupts-landed-block not applied: {type(exc).__name__}: {exc}\n")


def _apply(name: str, arg: str, module) -> None:
    cls = getattr(module, _TARGETS[name][1])
    if name == "p-sends-full-allocation":
        _full_allocation(cls)
    else:
        _corrupt_landed(cls, int(arg or 1))


class _Finder:
    """Lets the real finders load a fault's module, then applies the fault (as sitecustomize.py's NIXL finder)."""

    def __init__(self, armed: dict):
        self.armed = armed  # module -> [(fault, arg)]

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.armed:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, todo = spec.loader, self.armed.pop(fullname)

        class _Loader:
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                for name, arg in todo:
                    try:
                        _apply(name, arg, module)
                    except Exception as exc:
                        sys.stderr.write(f"labelled_faults: {name} not applied: {type(exc).__name__}: {exc}\n")

        spec.loader = _Loader()
        return spec


def install() -> None:
    armed: dict = {}
    for item in filter(None, (os.environ.get(ENV) or "").split(",")):
        name, _, arg = item.partition(":")
        if name not in _TARGETS:
            sys.stderr.write(f"labelled_faults: unknown fault {name!r} (known: {', '.join(_TARGETS)})\n")
            continue
        mod = _TARGETS[name][0]
        if mod in sys.modules:
            _apply(name, arg, sys.modules[mod])
        else:
            armed.setdefault(mod, []).append((name, arg))
    if armed:
        sys.meta_path.insert(0, _Finder(armed))
