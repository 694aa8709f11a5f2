"""Model runner V2 hooks around a step: GPUModelRunner.execute_model's target phase and the
connector lifecycle (hooks/spec_v2.py), the accepted counts kept on the device
(hooks/states_v2.py), and the detectors on the events they record (vLLM 0.32.0).

Built for real on CPU: ``ActiveKVConnector`` (``gpu/kv_connector.py``: the real
``pre_forward`` / ``finish_forward`` / ``post_forward`` on an instance whose attributes are set
as its ``__init__`` sets them, holding a real NixlConnector whose NIXL worker is a subclass of
the real ``NixlPullConnectorWorker`` overriding only the calls ``post_forward`` makes),
``MambaHybridModelState(vllm_config, model, None, cpu)``, the speculators from the real
``init_speculator``. Driven through faithful minimal callers: ``execute_model`` /
``sample_tokens`` in 0.32.0's order (pre_forward, target forward, finish_forward; then
propose, then post_forward) and each speculator's ``propose`` with its real signature.
Shared set-up: tests/v2lib.py.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from pdtrace.record import recorder  # noqa: E402
from pdtrace.hooks import spec_v2, states_v2  # noqa: E402
from pdtrace.record.recorder import Recorder  # noqa: E402
from pdtrace.testing import worker_sim as ws  # noqa: E402
from v2lib import (ROWS, build_speculator, call_propose, cpu_uva, events, faithful_propose,  # noqa: E402,F401 - fixtures
                   input_batch, installed, rec)

pytestmark = pytest.mark.vllm


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
