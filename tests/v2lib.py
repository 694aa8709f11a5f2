"""Shared set-up of the model runner V2 hook tests (test_hooks_v2.py, test_hooks_v2_step.py):
the hooks installed, an in-memory recorder, vLLM's CPU UvaBuffer, a real V2 InputBatch, real
speculators from init_speculator, and the faithful propose caller. See test_hooks_v2.py's
docstring for what is real and what is a faithful minimal caller."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

from pdtrace import hooks
from pdtrace.hooks import spec_v2, states_v2
from eventlib import rec, recorded  # noqa: F401 - rec: the worker recorder fixture

ALL_SPECS = (*spec_v2.SPECS, *states_v2.SPECS)


@pytest.fixture(scope="module", autouse=True)
def installed():
    hooks.install_now()
    for s in ALL_SPECS:
        assert s.status == "applied", (s.name, s.reason)
    yield


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
