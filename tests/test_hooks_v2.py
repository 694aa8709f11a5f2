"""Model runner V2 hooks: hooks/spec_v2.py and hooks/states_v2.py (vLLM 0.32.0).

Built for real on CPU here:
- ``vllm.v1.worker.gpu.states.RequestState`` (device cpu, with vLLM's CPU ``UvaBuffer`` from
  ``vllm/v1/worker/cpu/buffer_utils.py``, the substitution vLLM's CPU worker makes in
  ``cpu/shm.py``; pinned memory does not exist on this host): real add_request / remove_request.
- ``EagleSpeculator`` and ``DFlashSpeculator``, each built by the real
  ``init_speculator(vllm_config, cpu, req_states)`` on pd_harness's VllmConfig (tiny local
  draft models), so ``method``, ``num_speculative_steps`` and ``num_query_per_req`` are vLLM's.
- ``vllm.v1.worker.gpu.input_batch.InputBatch`` from its own ``make_dummy`` on CPU
  ``InputBuffers``, with the per-request fields a step sets (``dataclasses.replace``).
- ``MambaHybridModelState(vllm_config, model, None, cpu)``: its real ``__init__`` runs.
- ``ActiveKVConnector`` (``gpu/kv_connector.py``): the real ``pre_forward`` / ``finish_forward``
  / ``post_forward`` on an instance whose attributes are set as its ``__init__`` sets them
  (``__init__`` itself needs the process's KV transfer group), holding a real NixlConnector.
  The NIXL worker under it (NIXL agent, registered memory) is a subclass of the real
  ``NixlPullConnectorWorker`` that overrides only the calls ``post_forward`` makes.

Driven through faithful minimal callers (the real bodies need a loaded model and Triton):
``GPUModelRunner.execute_model`` / ``sample_tokens`` (0.32.0's order: pre_forward, target
forward, finish_forward; then propose, then post_forward), every speculator's ``propose``
(real signature, called on the real speculator instance), ``NgramGPUSpeculator`` (its
``__init__`` raises without Triton: an instance made with ``object.__new__`` and the two
attributes propose's hook reads).

This file: the hooks' targets, RequestState slots, drafter windows and phases. The step
(execute_model, the connector lifecycle, acc.device, the detectors on V2 events) is in
test_hooks_v2_step.py; the shared set-up in v2lib.py.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from pdtrace import hooks
from pdtrace.record import recorder  # noqa: E402
from pdtrace.hooks import spec_v2, states_v2  # noqa: E402
from eventlib import RaisingRecorder  # noqa: E402
from v2lib import (ALL_SPECS, ROWS, build_speculator, call_propose, cpu_uva, events,  # noqa: E402,F401 - fixtures
                   faithful_propose, input_batch, installed, rec)

pytestmark = pytest.mark.vllm


# ---------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------

def test_v2_hooks_match_installed_vllm_and_cover_every_speculator():
    """Every target resolves with the expected parameters; every speculator class in
    gpu/spec_decode that defines its own propose is hooked (a new one fails this test)."""
    import vllm.v1.worker.gpu.spec_decode as pkg
    from vllm.v1.worker.gpu import model_runner as mr
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    for s in ALL_SPECS:
        assert hooks.check(s) == ("ok", ""), s.name
        assert s.runner == "v2", s.name
    assert getattr(mr.init_speculator, "__pdtrace_hook__", None) == "spec_v2.init_speculator"
    own = set()
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if (isinstance(obj, type) and issubclass(obj, BaseSpeculator) and obj.__module__ == mod.__name__
                    and "propose" in vars(obj) and not getattr(obj.propose, "__isabstractmethod__", False)):
                own.add((obj.__module__, obj.__name__))
    assert own == set(spec_v2.SPECULATORS)
    for mod, cls in spec_v2.SPECULATORS:
        klass = getattr(importlib.import_module(mod), cls)
        assert vars(klass)["propose"].__pdtrace_hook__ == f"spec_v2.propose.{cls}"


# ---------------------------------------------------------------------------------------
# rows: RequestState slots (real class on CPU)
# ---------------------------------------------------------------------------------------

def test_request_state_slots_real(rec, cpu_uva):
    from vllm.v1.worker.gpu.states import RequestState

    rs = RequestState(4, 64, 128, 3, 1000, torch.device("cpu"))
    rs.add_request("a", 5, [1, 2, 3, 4, 5], 0, 10)
    rs.add_request("b", 3, [1, 2, 3], 0, 10)
    assert rs.remove_request("a") == rs.free_indices[-1]
    assert rs.remove_request("never-added") is None  # add_requests' streaming re-add guard: no event
    rs.add_request("c", 4, [1, 2, 3, 4], 0, 10)  # takes a's slot at once (free_indices is a stack)
    got = [(e["ev"], e["req"], e["row"], e["runner"]) for e in events(rec, "batch.add", "batch.remove")]
    slot_a = got[0][2]
    assert got == [("batch.add", "a", slot_a, "v2"), ("batch.add", "b", rs.req_id_to_index["b"], "v2"),
                   ("batch.remove", "a", slot_a, "v2"), ("batch.add", "c", slot_a, "v2")]
    assert rs.req_id_to_index == {"b": got[1][2], "c": slot_a}


# ---------------------------------------------------------------------------------------
# drafter phase and windows (real speculators from init_speculator)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,k,n", [("eagle", 3, 3), ("dflash", 3, 4)])
def test_drafter_windows_and_phase_on_real_speculators(rec, cpu_uva, pd_harness, method, k, n):
    _vc, spec = build_speculator(pd_harness, method, k)
    cls = {"eagle": "TargetDependentARSpeculator", "dflash": "DFlashSpeculator"}[method]
    assert type(spec).propose.__pdtrace_hook__ == f"spec_v2.propose.{cls}"  # resolved through the MRO
    spec.draft_attn_layer_names = {"draft.layers.1.attn", "draft.layers.0.attn"}  # as load_model sets it
    wrapped = spec_v2.PROPOSE[cls].wrap(faithful_propose())
    ib = input_batch(ROWS)
    out = call_propose(wrapped, spec, ib, num_speculative_tokens=k)
    assert out.shape == (3, 3) and rec.phase == ""
    wins = [(e["req"], e["start"], e["end"], e["method"]) for e in events(rec, "spec.window")]
    assert wins == [("dec", 40, 40 + n, method), ("fin", 12, 12 + n, method)]  # "mid" sampled nothing
    ph = events(rec, "spec.phase")
    assert [(e["phase"], e["edge"], e["runner"]) for e in ph] == [("drafter", "begin", "v2"), ("drafter", "end", "v2")]
    assert ph[0]["method"] == method and ph[0]["layers"] == ["draft.layers.0.attn", "draft.layers.1.attn"]
    # dummy / profile runs are not steps
    rec.events.clear()
    call_propose(wrapped, spec, ib, dummy_run=True)
    assert events(rec) == []


def test_ngram_drafter_has_phase_but_no_window(rec, pd_harness):
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    vc = pd_harness.build_vllm_config("P", pd_harness.PDConfig(spec_method="ngram"))
    spec = object.__new__(NgramGPUSpeculator)  # its __init__ raises without Triton
    spec.speculative_config, spec.num_speculative_steps = vc.speculative_config, 3
    wrapped = spec_v2.PROPOSE["NgramGPUSpeculator"].wrap(faithful_propose())
    call_propose(wrapped, spec, input_batch(ROWS[:1]))
    assert events(rec, "spec.window") == []  # ngram writes no KV of its own
    assert [(e["edge"], e.get("method")) for e in events(rec, "spec.phase")] == [("begin", "ngram"), ("end", None)]


def test_init_speculator_patches_an_unlisted_speculator_class(rec, cpu_uva, pd_harness):
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    vc, real = build_speculator(pd_harness, "eagle")

    class NewSpeculator(EagleSpeculator):  # a class vLLM might add: its own propose
        def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                    num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                    dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                    is_profile=False, num_speculative_tokens=None):
            return "drafted"

    obj = object.__new__(NewSpeculator)
    obj.__dict__.update(vars(real))
    init = spec_v2.INIT_SPECULATOR.wrap(lambda vllm_config, device, req_states: obj)
    assert init(vc, torch.device("cpu"), None) is obj
    name = f"spec_v2.propose[{NewSpeculator.__module__}.{NewSpeculator.__qualname__}]"
    spec = hooks.REGISTRY[name]
    try:
        assert spec.status == "applied" and vars(NewSpeculator)["propose"].__pdtrace_hook__ == name
        assert call_propose(NewSpeculator.propose, obj, input_batch(ROWS[:1])) == "drafted"
        assert [e["ev"] for e in events(rec, "spec.window", "spec.phase")] == ["spec.window", "spec.phase",
                                                                             "spec.phase"]
        assert spec_v2.patch_speculator_class(NewSpeculator) is None  # already hooked: nothing new
        assert spec_v2.patch_speculator_class(EagleSpeculator) is None  # listed class: hooked at install
    finally:
        NewSpeculator.propose = spec.original
        del hooks.REGISTRY[name]


def test_drafter_hook_error_is_counted_and_result_unchanged(pd_harness, cpu_uva):
    _vc, spec = build_speculator(pd_harness, "dflash")
    wrapped = spec_v2.PROPOSE["DFlashSpeculator"].wrap(faithful_propose())
    bad = RaisingRecorder("spec.window", role="worker")
    prev = recorder.set_current(bad)
    try:
        out = call_propose(wrapped, spec, input_batch(ROWS))
    finally:
        recorder.set_current(prev)
    assert out.shape == (3, 3)
    assert bad.hook_errors == {"spec_v2.propose.DFlashSpeculator": 1}
    assert bad.phase == ""  # the failed before opened no phase, so the after closed none


# ---------------------------------------------------------------------------------------
# a V2 step: target phase, real ActiveKVConnector, drafter; the metadata detector unchanged
# ---------------------------------------------------------------------------------------
