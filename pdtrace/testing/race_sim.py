"""vLLM #51571 on the real InputBatch: where the accepted-count copy lands decides the read.

Real parts (CPU): vLLM's ``InputBatch`` (add_request, remove_request, condense, swap_states)
and its real reorder function ``reorder_batch_to_split_decodes_and_prefills``
(``v1/attention/backends/utils.py``, what ``GPUModelRunner._may_reorder_batch`` calls), with
pdtrace's hooks on them. Simulated (GPU-only): the align postprocess's non-blocking D2H copy and
its CUDA event (``worker_sim.FakeCudaEvent``: the copy lands when the test says), and the
accepted-count branch of ``_prepare_inputs`` written as 0.32.0 / 0.33.0 have it (synchronize,
then the gather through ``prev_positions`` from ``input_batch.num_accepted_tokens_cpu``).

The scenario is the one in the issue: rows [A, B, C] hold counts [1, 3, 4]; B finishes, a new
request N takes B's row, the reorder puts the decode C before the prefill N (a swap). ``order``
says where the copy lands: "before" the step's row moves (what the GPU does when the copy is
quick), "after" them (at the synchronize), or "during" the swap (the trace can only say
"unknown"). ``fix``: the same with vLLM PR #51599's approach (LABELLED: the copy goes to a
runner-owned snapshot that rows do not move, and the gather reads it).

The oracle is the real buffer, not the detector: each decode's value read against its own count.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import worker_sim as ws

COUNTS = {"A": 1, "B": 3, "C": 4}
ORDERS = ("before", "after", "during")


class _LandsAtQuery(ws.FakeCudaEvent):
    """A fake event whose copy lands at its ``n``-th ``query()`` (before answering it)."""

    def __init__(self, stream: list, n: int | None) -> None:
        super().__init__(stream)
        self.n = n
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.n is not None and self.queries >= self.n and not self.done:
            self.complete()
        return self.done


def _postprocess(*, bufs: Any, num_reqs: int, num_accepted_tokens_gpu: Any, num_accepted_tokens_cpu_tensor: Any,
                 input_batch: Any, kv_cache_config: Any, forward_context: Any, mamba_state_copy_funcs: Any) -> None:
    """As mamba_utils.postprocess_mamba_align_gpu's last line: the non-blocking D2H copy."""
    src = num_accepted_tokens_gpu[:num_reqs].clone()
    dst = num_accepted_tokens_cpu_tensor
    bufs.stream.append(lambda: dst[:num_reqs].copy_(src))


def _update_states_after_model_execute(self: Any, output_token_ids: Any, scheduler_output: Any) -> None:
    """0.32.0's align branch: count, the postprocess's copy (into the InputBatch buffer, or the
    runner's snapshot with the #51599 approach), event.record()."""
    n = output_token_ids.size(0)
    self.num_accepted_tokens_gpu[:n] = (output_token_ids != -1).sum(dim=1)
    dest = self.snapshot if self.fix else self.input_batch.num_accepted_tokens_cpu_tensor
    self.postprocess(bufs=self, num_reqs=n, num_accepted_tokens_gpu=self.num_accepted_tokens_gpu,
                     num_accepted_tokens_cpu_tensor=dest, input_batch=self.input_batch, kv_cache_config=None,
                     forward_context=None, mamba_state_copy_funcs=None)
    self.num_accepted_tokens_event.record()


def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> tuple:
    """0.32.0's accepted-count branch under async scheduling in align mode (the #51599 approach
    gathers from the snapshot instead)."""
    import numpy as np

    ib = self.input_batch
    num_reqs = ib.num_reqs
    prev = ib.prev_req_id_to_index
    prev_idx = np.array([prev.get(r, -1) for r in ib.req_ids[:num_reqs]], dtype=np.int64)
    self.num_accepted_tokens_event.synchronize()
    new_mask = prev_idx < 0
    src = self.snapshot.numpy() if self.fix else ib.num_accepted_tokens_cpu
    vals = src[np.where(new_mask, 0, prev_idx)].copy()
    vals[new_mask] = 1
    ib.num_accepted_tokens_cpu[:num_reqs] = vals
    return (None, None, num_reqs)


def run(rec: Any, order: str, fix: bool = False, k: int = 3) -> dict:
    """One step pair; returns what each decode read and its own count (the oracle)."""
    import torch

    from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills

    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}")
    out: dict = {"order": order, "fix": fix, "reads": {}}
    with ws._recording(rec):
        ib = ws.make_input_batch(8, k=k)
        r = ws._acc_runner(ib, k, "fixed")
        r.fix = fix
        r.snapshot = torch.ones(ib.max_num_reqs, dtype=torch.int32)
        # "during": the copy lands at the 6th query() (issue 1, settle 2, add 3-4, swap 5-6): the one
        # just after the swap ran, so the swap's record says "unknown"
        r.num_accepted_tokens_event = _LandsAtQuery(r.stream, 6 if order == "during" else None)
        r.postprocess = ws._wrapped("accepted_counts.align_dest", _postprocess)
        upd = ws._wrapped("accepted_counts.issue", _update_states_after_model_execute)
        prep = ws._wrapped("accepted_counts.read", _prepare_inputs)
        settle = ws._wrapped("accepted_counts.settle", lambda self, scheduler_output: None)
        rec.step = 1
        for name in ("A", "B", "C"):
            ib.add_request(ws.make_request_state(name, 8))
            ib.num_computed_tokens_cpu[ib.req_id_to_index[name]] = 8  # decoding
        ids = list(ib.req_ids[:ib.num_reqs])
        out_ids = torch.full((len(ids), k + 1), -1, dtype=torch.int64)
        for row, name in enumerate(ids):
            out_ids[row, :COUNTS[name]] = 7
        ib.prev_req_id_to_index = {q: j for j, q in enumerate(ids)}
        with ws._simulated(rec):
            upd(r, out_ids, None)  # step 1's copy, in flight
        rec.step = 2
        if order == "before":
            r.num_accepted_tokens_event.complete()  # the GPU finished the copy before step 2 began
        with ws._simulated(rec):
            settle(r, None)  # _update_states starts: d2h.done when query() shows it landed
        # _update_states: B finishes, N takes its row, the backend's reorder (real) swaps C before N
        ib.remove_request("B")
        ib.add_request(ws.make_request_state("N", 20))
        ib.condense()
        so = SimpleNamespace(num_scheduled_tokens={"A": 1 + k, "C": 1 + k, "N": 20})
        reorder_batch_to_split_decodes_and_prefills(ib, so, decode_threshold=1 + k)
        out["rows"] = list(ib.req_ids[:ib.num_reqs])
        with ws._simulated(rec):
            prep(r, None, None)  # synchronize, then the gather through prev_positions
        for row, name in enumerate(ib.req_ids[:ib.num_reqs]):
            if name in COUNTS:
                out["reads"][name] = {"row_now": row, "value": int(ib.num_accepted_tokens_cpu[row]),
                                      "own": COUNTS[name]}
    out["wrong"] = sorted(q for q, x in out["reads"].items() if x["value"] != x["own"])
    return out
