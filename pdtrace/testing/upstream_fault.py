"""FAULT fixture for vLLM's own test suite: re-introduce the pre-fix P block rule.

Load it into a pytest run of vLLM's tests with ``-p pdtrace.testing.upstream_fault``
(``tests/test_upstream_vllm.py`` does, under ``pdtrace record``). It is a labelled fault
injection, never used in production:

- vLLM 0.32.0's ``Scheduler._connector_finished`` hands the connector
  ``kv_cache_manager.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)``:
  each group's blocks clipped to the tokens P computed. Before the upstream fix it handed
  ``kv_cache_manager.get_block_ids(request_id)``: P's whole allocation, lookahead blocks
  included (seed 000/001). This plugin patches that one method on the ``KVCacheManager``
  class so that it returns the full allocation again.
- Ground truth, written independently of the detectors: every request whose
  ``_connector_finished`` handed kv_transfer_params with ``remote_block_ids`` to the
  client while the full allocation differed from the clipped one is appended as a JSON
  line to the file named by ``PDTRACE_FAULT_TRUTH`` (scheduler id as recorded in
  ``sched.config.sched``, request id, both block lists). A request whose params carry no
  blocks (a consumer finishing, an error) is not affected: nothing wrong reaches a D.
- Each patched process emits one ``fault.inject`` event into the trace being recorded, and one
  more per P report the fault changed (with the request), so that a per-test trace
  (``pytest --pdtrace``) carries the label where the fault acted.

``PDTRACE_UPSTREAM_FAULT=truth`` puts no fault back: it only writes the same ground truth for the
release's own ``_connector_finished`` (``truth_only``), for a release that still has the bug.

A second, separate knob gives vLLM's tests a fresh shape of input:
``PDTRACE_UPSTREAM_SPEC_TOKENS=k`` changes the default of ``num_speculative_tokens`` in
vLLM's test helper ``tests/v1/kv_connector/unit/utils.py:create_vllm_config`` from None to
k, and ``VllmConfig.num_lookahead_tokens`` answers k as it does for EAGLE / MTP / draft
models (ngram reserves none, and the helper can only build ngram configs), so that P
allocates lookahead blocks, the case the fault needs. The scheduler reads nothing else of
the drafter. It is a ``mark`` event in the trace, not a fault.
"""

from __future__ import annotations

import json
import os
from typing import Any

RULE = "p-sends-full-allocation"
_patched = False


def _truth(line: dict) -> None:
    path = os.environ.get("PDTRACE_FAULT_TRUTH")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # pytest's "<nodeid> (call)"
    if test:
        line = {**line, "test": test}
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def apply() -> None:
    """Patch ``KVCacheManager.get_block_ids_for_computed_tokens`` (idempotent)."""
    global _patched
    if _patched:
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from pdtrace.record import recorder

    from vllm.v1.core.sched.scheduler import Scheduler

    fixed = KVCacheManager.get_block_ids_for_computed_tokens
    changed: dict[tuple[int, str], dict] = {}

    def full_allocation(self: Any, request_id: str, num_computed_tokens: int) -> Any:
        clipped = fixed(self, request_id, num_computed_tokens)
        full = self.get_block_ids(request_id)
        if [list(g) for g in full] != [list(g) for g in clipped]:
            changed[(id(self), request_id)] = {
                "num_computed_tokens": num_computed_tokens,
                "full": [list(g) for g in full], "clipped": [list(g) for g in clipped]}
        return full

    connector_finished = Scheduler._connector_finished

    def judged(self: Any, request: Any) -> Any:
        out = connector_finished(self, request)
        diff = changed.pop((id(self.kv_cache_manager), request.request_id), None)
        params = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        if diff is not None and isinstance(params, dict) and params.get("remote_block_ids"):
            _truth({"sched": getattr(self, "_pdtrace_sid", None), "req": request.request_id, **diff})
            rec = recorder.get()
            if rec is not None:  # where the fault acted: in the trace then being recorded (a test's, under --pdtrace)
                rec.emit("fault.inject", req=request.request_id, rule=RULE,
                         detail=f"this P report carries the full allocation {diff['full']}, not {diff['clipped']}")
        return out

    KVCacheManager.get_block_ids_for_computed_tokens = full_allocation
    Scheduler._connector_finished = judged
    _patched = True
    rec = recorder.get()
    if rec is not None:
        rec.emit("fault.inject", rule=RULE,
                 detail="KVCacheManager.get_block_ids_for_computed_tokens -> get_block_ids "
                        "(pre-fix rule: P reports lookahead blocks beyond its computed tokens)")


def truth_only() -> None:
    """No fault: on whatever release is installed, write to ``PDTRACE_FAULT_TRUTH`` each request
    whose ``_connector_finished`` handed the client ``remote_block_ids`` with more blocks in some
    group than P's computed tokens fill (cdiv(num_computed_tokens, that group's block size)): the
    lookahead blocks a release that carries seed 000 reports (0.23.0, 0.24.0). Ground truth from
    the release's own output, written independently of the detectors."""
    from vllm.v1.core.sched.scheduler import Scheduler

    connector_finished = Scheduler._connector_finished

    def judged(self: Any, request: Any) -> Any:
        out = connector_finished(self, request)
        params = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        if isinstance(params, dict) and params.get("remote_block_ids"):
            groups = self.kv_cache_config.kv_cache_groups
            n = int(request.num_computed_tokens)
            reported = [list(g) for g in params["remote_block_ids"]]
            extra = [g for g, ids in enumerate(reported)
                     if g < len(groups) and len(ids) > -(-n // groups[g].kv_cache_spec.block_size)]
            if extra:
                _truth({"sched": getattr(self, "_pdtrace_sid", None), "req": request.request_id,
                        "num_computed_tokens": n, "reported": reported, "groups": extra})
        return out

    Scheduler._connector_finished = judged


def spec_shape(k: int) -> None:
    """Make vLLM's test helper build configs with an ngram drafter of k tokens by default."""
    import inspect

    from tests.v1.kv_connector.unit import utils  # vLLM's test tree, cwd = its source root

    fn = utils.create_vllm_config
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.default is not inspect.Parameter.empty]
    if "num_speculative_tokens" in names:
        defaults = list(fn.__defaults__ or ())
        defaults[names.index("num_speculative_tokens")] = k
        fn.__defaults__ = tuple(defaults)
    else:  # older helpers (0.24.0) take no drafter: give every config they build the same ngram drafter
        from vllm.config import SpeculativeConfig

        def with_drafter(*args: Any, **kwargs: Any) -> Any:
            vc = fn(*args, **kwargs)
            if vc.speculative_config is None:
                spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
                                         prompt_lookup_min=2)
                # these releases' Scheduler reserves lookahead only for EAGLE / draft models / DFlash
                # (scheduler.py ~L240 in 0.24.0): answer use_eagle() as EAGLE's config does, nothing else
                object.__setattr__(spec, "use_eagle", lambda: True)
                vc.speculative_config = spec
            return vc

        utils.create_vllm_config = with_drafter  # before vLLM's test modules import it by name

    from vllm.config import VllmConfig

    def eagle_lookahead(self: Any) -> int:  # config/vllm.py: use_eagle() -> num_speculative_tokens
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    VllmConfig.num_lookahead_tokens = property(eagle_lookahead)
    from pdtrace.record import recorder

    rec = recorder.get()
    if rec is not None:
        rec.emit("mark", label="upstream-spec-shape",
                 detail=f"vLLM tests' create_vllm_config(num_speculative_tokens=None -> {k}, ngram); "
                        "VllmConfig.num_lookahead_tokens = num_speculative_tokens (EAGLE's rule)")


def pytest_configure(config: Any) -> None:  # pytest plugin entry point
    k = os.environ.get("PDTRACE_UPSTREAM_SPEC_TOKENS")
    if k:
        spec_shape(int(k))
    mode = os.environ.get("PDTRACE_UPSTREAM_FAULT", "1")
    if mode == "truth":
        truth_only()
    elif mode != "0":
        apply()
