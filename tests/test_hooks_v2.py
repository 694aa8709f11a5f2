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
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from pdtrace import hooks, recorder, schema  # noqa: E402
from pdtrace.hooks import spec_v2, states_v2  # noqa: E402
from pdtrace.recorder import Recorder  # noqa: E402
from pdtrace.testing import worker_sim as ws  # noqa: E402
from eventlib import RaisingRecorder, recorded  # noqa: E402

pytestmark = pytest.mark.vllm
ALL_SPECS = (*spec_v2.SPECS, *states_v2.SPECS)


@pytest.fixture(scope="module", autouse=True)
def installed():
    hooks.install_now()
    for s in ALL_SPECS:
        assert s.status == "applied", (s.name, s.reason)
    yield


@pytest.fixture
def rec():
    r = Recorder.in_memory(role="worker", inst="P")
    prev = recorder.set_current(r)
    yield r
    recorder.set_current(prev)


@pytest.fixture
def cpu_uva(monkeypatch):
    """vLLM's CPU worker's UvaBuffer (vllm/v1/worker/cpu/shm.py does this substitution)."""
    import vllm.v1.worker.cpu.buffer_utils as cpu_buf
    import vllm.v1.worker.gpu.buffer_utils as gpu_buf

    monkeypatch.setattr(gpu_buf, "UvaBuffer", cpu_buf.UvaBuffer)


events = recorded  # tests/eventlib.py


def input_batch(rows):
    """A real V2 InputBatch: rows = [(req, seq_len_upper_bound, scheduled, prefill_len, computed_prefill)]."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    n = len(rows)
    sched = np.array([r[2] for r in rows], dtype=np.int32)
    ib = InputBatch.make_dummy(n, int(sched.sum()), InputBuffers(8, 256, torch.device("cpu")))
    return dataclasses.replace(
        ib, req_ids=[r[0] for r in rows], num_scheduled_tokens=sched,
        seq_lens_cpu_upper_bound=torch.tensor([r[1] for r in rows], dtype=torch.int32),
        prefill_len_np=np.array([r[3] for r in rows], dtype=np.int32),
        num_computed_prefill_tokens_np=np.array([r[4] for r in rows], dtype=np.int32),
        idx_mapping_np=np.array([5, 2, 7][:n], dtype=np.intp))


# decode row (prompt done), a prefill that completes this step, a chunk mid-prefill
ROWS = [("dec", 40, 4, 30, 30), ("fin", 12, 12, 12, 0), ("mid", 8, 8, 30, 0)]


def build_speculator(pd_harness, method, k=3):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.states import RequestState

    vc = pd_harness.build_vllm_config("P", pd_harness.PDConfig(spec_method=method, num_spec_tokens=k))
    with set_current_vllm_config(vc):
        rs = RequestState(8, 256, 256, k, 1000, torch.device("cpu"))
        return vc, init_speculator(vc, torch.device("cpu"), rs)


def faithful_propose(layers=(), conn=None):
    """The real propose signature; the body stands in for the drafter forward(s): each drafter
    attention layer asks the connector, as maybe_transfer_kv_layer does."""

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None):
        for n in layers:
            if conn is not None and conn.has_connector_metadata():
                conn.save_kv_layer(n, None, None)
        return torch.zeros(input_batch.num_reqs, 3, dtype=torch.int64)

    real = inspect.signature(spec_v2.PROPOSE["TargetDependentARSpeculator"].original)
    assert list(inspect.signature(propose).parameters) == list(real.parameters)
    return propose


def call_propose(wrapped, spec, ib, **kw):
    return wrapped(spec, ib, None, None, None, None, None, None, None, None, None, None, **kw)


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

def _active_connector(vc):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    class Worker(NixlPullConnectorWorker):  # the NIXL agent side: only what post_forward calls
        use_host_buffer, copy_blocks, pcp_rank, pcp_dcp_sharded = False, None, 0, False

        def start_load_kv(self, metadata):
            self.loads = getattr(self, "loads", 0) + 1

        def get_transfer_results(self):
            return KVConnectorTransferResults()

        def get_block_ids_with_load_errors(self):
            return set()

        def get_kv_connector_stats(self):
            return None

    conn = ws.make_connector("kv_producer")
    conn.kv_transfer_config = conn._kv_transfer_config  # as NixlBaseConnector.__init__ sets it
    conn.connector_worker = object.__new__(Worker)
    active = object.__new__(ActiveKVConnector)  # __init__ asks the process's KV transfer group
    active.vllm_config, active.kv_connector = vc, conn
    active._pending_load_kwargs, active._disabled = None, False
    return active, conn


def faithful_execute_model(model):
    """GPUModelRunner.execute_model (V2, 0.32.0) reduced to its connector calls around the
    target forward: pre_forward(scheduler_output, input_batch), model, finish_forward()."""

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False,
                      skip_attn_for_dummy_run=False, is_profile=False, context_len=0,
                      valid_dummy_state_slots=False, randomize_inputs=False):
        self.kv_connector.pre_forward(scheduler_output, self.input_batch)
        model()
        self.kv_connector.finish_forward()
        return None

    real = inspect.signature(spec_v2.TARGET.original)
    assert list(inspect.signature(execute_model).parameters) == list(real.parameters)
    return execute_model


@pytest.mark.parametrize("order", ["fixed", "clear-first"])
def test_v2_step_phases_connector_events_and_metadata_detector(rec, cpu_uva, pd_harness, order):
    """0.32.0's sample_tokens runs propose, then post_forward (which clears); 0.33.0's runs
    post_forward(defer_finalize=True), propose, finalize_step() (which clears): no finding
    either way. "clear-first" calls post_forward before propose without deferring: the
    unchanged metadata detector flags the step on P."""
    from pdtrace.detectors.metadata import detect

    vc, spec = build_speculator(pd_harness, "eagle")
    spec.draft_attn_layer_names = {"d0"}
    active, conn = _active_connector(vc)

    def layers(names):
        def model():
            for n in names:
                if conn.has_connector_metadata():
                    conn.save_kv_layer(n, None, None)
        return model

    ib = input_batch(ROWS[:2])
    runner = SimpleNamespace(kv_connector=active, input_batch=ib)
    so = SimpleNamespace(kv_connector_metadata=ws.make_metadata(["dec", "fin"]), has_sync_kv_loads=False,
                         finished_req_ids=set())
    execute = spec_v2.TARGET.wrap(faithful_execute_model(layers(["t0", "t1"])))
    propose = spec_v2.PROPOSE["TargetDependentARSpeculator"].wrap(faithful_propose(["d0"], conn))
    assert execute(runner, so) is None
    if order == "fixed" and hasattr(active, "finalize_step"):  # 0.33.0: deferred finalize around propose
        out = active.post_forward(so.finished_req_ids, defer_finalize=True)
        call_propose(propose, spec, ib, num_speculative_tokens=3)
        active.finalize_step()
    elif order == "fixed":  # 0.32.0: propose, then post_forward
        call_propose(propose, spec, ib, num_speculative_tokens=3)
        out = active.post_forward(so.finished_req_ids)
    else:
        out = active.post_forward(so.finished_req_ids)
        call_propose(propose, spec, ib, num_speculative_tokens=3)
    assert out is not None and conn.connector_worker.loads == 1  # the real post_forward started the load
    assert conn._connector_metadata is None
    seq = [(e["ev"], e.get("phase"), e.get("edge") or e.get("layer") or e.get("result"))
           for e in events(rec) if e["ev"].startswith(("kvmeta.", "spec.phase"))]
    # execute_model brackets the bind (pre_forward) as well as the forward: bind inside the phase
    target = [("spec.phase", "target", "begin"), ("kvmeta.bind", None, None),
              ("kvmeta.has", "target", True), ("kvmeta.save_layer", "target", "t0"),
              ("kvmeta.has", "target", True), ("kvmeta.save_layer", "target", "t1"),
              ("spec.phase", "target", "end")]
    drafter_ok = [("spec.phase", "drafter", "begin"), ("kvmeta.has", "drafter", True),
                  ("kvmeta.save_layer", "drafter", "d0"), ("spec.phase", "drafter", "end")]
    post = [("kvmeta.wait_for_save", "", None), ("kvmeta.clear", "", None)]
    if order == "fixed":
        assert seq == target + drafter_ok + post
    else:
        assert seq == target + post + [("spec.phase", "drafter", "begin"), ("kvmeta.has", "drafter", False),
                                       ("spec.phase", "drafter", "end")]
    evs = [dict(e, id=i) for i, e in enumerate(events(rec))]
    found = detect(evs)
    if order == "fixed":
        assert found == []
    else:
        assert len(found) == 1 and found[0].inst == "P" and found[0].data["drafter_layers_not_saved"] == ["d0"]


# ---------------------------------------------------------------------------------------
# accepted counts stay on the device (real MambaHybridModelState.__init__)
# ---------------------------------------------------------------------------------------

def test_acc_device_from_real_mamba_hybrid_state(rec, cpu_uva, pd_harness):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    vc = pd_harness.build_vllm_config("P", pd_harness.PDConfig(spec_method="eagle"))
    with set_current_vllm_config(vc):
        ms = MambaHybridModelState(vc, torch.nn.Linear(2, 2), None, torch.device("cpu"))
    got = events(rec, "acc.device")
    assert len(got) == 1
    e = got[0]
    assert e["holder"] == "vllm.v1.worker.gpu.model_states.mamba_hybrid.MambaHybridModelState"
    assert (e["attr"], e["device"], e["keyed_by"], e["cpu_copy"], e["runner"]) == (
        "num_accepted_tokens_gpu", str(ms.num_accepted_tokens_gpu.device), "slot", False, "v2")
    # a holder with a host-side count buffer beside the device one is reported as such
    ms.num_accepted_tokens_cpu = np.ones(4, dtype=np.int32)
    assert states_v2._host_copies(ms) == ["num_accepted_tokens_cpu"]


# ---------------------------------------------------------------------------------------
# the drafter-window detector, unchanged, on a V2 worker's events
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", [True, False])
def test_drafter_window_detector_on_v2_events(pd_harness, cpu_uva, fault):
    """A real P/D DFlash request through real vLLM schedulers (k=3, prompt 29, block 16), with
    and without the pre-fix lookahead rule (k instead of k+1 slots), then P's V2 worker: the
    real RequestState gives the request its slot (batch.add) and the hook on the real
    DFlashSpeculator's propose records its window [29, 33). The drafter-window detector reads
    them as it reads V1's events: outside P's 2 blocks (32 positions) only with the fault."""
    from vllm.v1.worker.gpu.states import RequestState

    from pdtrace.detectors.drafter_window import detect

    k, prompt_len = 3, 29
    cfg = pd_harness.PDConfig(spec_method="dflash", num_spec_tokens=k, block_size=16)
    r = pd_harness.run_pd_request(cfg, prompt_len, faults=("old_dflash_lookahead",) if fault else ())
    _vc, spec = build_speculator(pd_harness, "dflash", k)
    w = Recorder.in_memory(role="worker", inst="P")
    prev = recorder.set_current(w)
    try:
        rs = RequestState(8, 256, 256, k, 1000, torch.device("cpu"))
        rs.add_request(r.p_req, prompt_len, list(range(prompt_len)), 0, 1)
        wrapped = spec_v2.PROPOSE["DFlashSpeculator"].wrap(faithful_propose())
        call_propose(wrapped, spec, input_batch([(r.p_req, prompt_len, prompt_len, prompt_len, 0)]))
    finally:
        recorder.set_current(prev)
    wev = events(w)
    win = [e for e in wev if e["ev"] == "spec.window"]
    assert [(e["req"], e["start"], e["end"], e["method"]) for e in win] == [(r.p_req, 29, 33, "dflash")]
    merged = [dict(e, id=i) for i, e in enumerate(sorted([*r.events, *wev], key=lambda e: e["t"]))]
    found = detect(merged)
    first = next(e for e in r.events if e["ev"] == "sched.alloc" and e.get("req") == r.p_req and e.get("ok"))
    assert len(first["block_ids"][0]) == (2 if fault else 3)
    if fault:
        assert [(f.req, f.inst) for f in found] == [(r.p_req, "P")]
        assert found[0].data["start"] == 29 and found[0].data["end"] == 33
    else:
        assert found == []


def test_v2_step_with_nothing_scheduled_opens_no_target_phase(rec, cpu_uva, pd_harness):
    """On the H100 (docs/live-gpu.md) V2's execute_model was called on every engine step, also
    when nothing was scheduled (P idling while D reads): it then returns before any forward
    (``total_num_scheduled_tokens == 0`` -> ``kv_connector.no_forward``). Such a call records no
    spec.phase; a step with tokens still does. The faithful caller has the real signature."""
    runner = SimpleNamespace(calls=0)

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False,
                      skip_attn_for_dummy_run=False, is_profile=False, context_len=0,
                      valid_dummy_state_slots=False, randomize_inputs=False):
        self.calls += 1
        return None

    assert list(inspect.signature(execute_model).parameters) == \
        list(inspect.signature(spec_v2.TARGET.original).parameters)
    execute = spec_v2.TARGET.wrap(execute_model)
    execute(runner, SimpleNamespace(total_num_scheduled_tokens=0))
    assert runner.calls == 1 and not [e for e in events(rec) if e["ev"] == "spec.phase"]
    execute(runner, SimpleNamespace(total_num_scheduled_tokens=5))
    assert [(e["phase"], e["edge"]) for e in events(rec) if e["ev"] == "spec.phase"] == \
        [("target", "begin"), ("target", "end")]
