"""Seed 004 in ``worker_sim``: the accepted-count copy and its CPU reads under async spec
decode, on a real ``InputBatch`` with the runner's own row moves (``accepted_counts_steps``;
see ``worker_sim``'s docstring)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .worker_sim_base import _SimRunner, _check_mode, _recording, _runner_method, _simulated, _wrapped


# ---------------------------------------------------------------------------------------
# (b) seed 004: accepted counts under async spec decode
# ---------------------------------------------------------------------------------------

class FakeCudaEvent:
    """CUDA event stand-in. ``record()`` captures the copies enqueued since the last record;
    they land (run) on ``synchronize()`` or ``complete()`` (the simulated GPU finishing).
    ``query()`` never blocks and never lands anything."""

    def __init__(self, stream: list) -> None:
        self._stream = stream
        self._ops: list = []
        self.done = True  # a never-recorded CUDA event queries True
        self.syncs = 0

    def record(self, *a: Any) -> None:
        self._ops = list(self._stream)
        self._stream.clear()
        self.done = not self._ops

    def query(self) -> bool:
        return self.done

    def complete(self) -> None:
        for op in self._ops:
            op()
        self._ops = []
        self.done = True

    def synchronize(self) -> None:
        self.syncs += 1
        self.complete()


def make_input_batch(max_num_reqs: int = 16, *, k: int = 3, block_size: int = 16, max_model_len: int = 1024) -> Any:
    """A real vLLM ``InputBatch`` on CPU (device cpu, pin_memory as vLLM decides on CPU)."""
    import inspect

    import torch
    from vllm.v1.worker.gpu_input_batch import InputBatch

    import vllm.v1.worker.gpu_input_batch as gib

    if getattr(gib, "PIN_MEMORY", False) and not torch.cuda.is_available():
        # vLLM 0.22-0.25 fix PIN_MEMORY at import from the platform, which this CPU host's CUDA wheel
        # leaves unresolved (pinned memory needs an accelerator): the InputBatch gets plain CPU tensors
        gib.PIN_MEMORY = False
    extra: dict = {}
    params = inspect.signature(InputBatch.__init__).parameters
    if "kernel_block_sizes" in params:  # vLLM 0.22-0.25
        extra["kernel_block_sizes"] = [block_size]  # the attention kernel's block = the KV cache block
    if "pin_memory" in params:  # vLLM 0.22-0.23: the caller says (the runner passes is_pin_memory_available())
        extra["pin_memory"] = False
    if "num_spec_tokens" in params:  # not in 0.20-0.21
        extra["num_spec_tokens"] = k
    return InputBatch(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
                      device=torch.device("cpu"), vocab_size=1000, block_sizes=[block_size],
                      max_num_blocks_per_req=[(max_model_len + block_size - 1) // block_size], **extra)


def make_request_state(req_id: str, prompt_len: int, block_ids: list[int] | None = None) -> Any:
    """A real ``CachedRequestState`` (token ids 0..prompt_len-1, greedy sampling)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(req_id=req_id, prompt_token_ids=list(range(prompt_len)), mm_features=[],
                              sampling_params=SamplingParams(temperature=0.0), generator=None,
                              block_ids=(list(block_ids or []),), num_computed_tokens=0, output_token_ids=[])


def _acc_runner(ib: Any, k: int, mode: str) -> Any:
    import torch

    r = _SimRunner()
    r.input_batch = ib
    r.speculative_config = SimpleNamespace(method="mtp", num_speculative_tokens=k)
    r.model_config = SimpleNamespace(is_hybrid=True)
    # "align": 0.32.0 reads the CPU copy on this path (after synchronize); the buggy runner
    # reads it too, without waiting.
    r.cache_config = SimpleNamespace(mamba_cache_mode="align")
    r.use_async_scheduling = True
    r.stream: list = []
    r.num_accepted_tokens_event = FakeCudaEvent(r.stream)
    r.valid_stream: list = []
    r.valid_sampled_token_count_event = FakeCudaEvent(r.valid_stream)
    r.valid_sampled_token_count_cpu = torch.zeros(ib.max_num_reqs, dtype=torch.int32)
    r.num_accepted_tokens_gpu = torch.ones(ib.max_num_reqs, dtype=torch.int32)  # "device" buffer
    r.mode = mode
    return r


def _update_states_after_model_execute(self: Any, output_token_ids: Any, scheduler_output: Any) -> None:
    """As 0.32.0 (non-align branch): count, non-blocking D2H copy, event.record()."""
    if not self.speculative_config or not self.model_config.is_hybrid:
        return
    n = output_token_ids.size(0)
    self.num_accepted_tokens_gpu[:n] = (output_token_ids != -1).sum(dim=1)
    src = self.num_accepted_tokens_gpu[:n].clone()  # what the stream copies
    dst = self.input_batch.num_accepted_tokens_cpu_tensor
    self.stream.append(lambda: dst[:n].copy_(src))  # copy_(..., non_blocking=True)
    self.num_accepted_tokens_event.record()


def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> tuple:
    """The accepted-count part of _prepare_inputs. fixed: 0.32.0 (synchronize, prev-row
    mapping). buggy: the racy read (no wait, current rows)."""
    import numpy as np

    ib = self.input_batch
    num_reqs = ib.num_reqs
    prev = ib.prev_req_id_to_index
    if self.mode == "fixed":
        self.num_accepted_tokens_event.synchronize()
        if self.use_async_scheduling and prev:
            prev_idx = np.array([prev.get(r, -1) for r in ib.req_ids[:num_reqs]], dtype=np.int64)
            new_mask = prev_idx < 0
            vals = ib.num_accepted_tokens_cpu[np.where(new_mask, 0, prev_idx)].copy()
            vals[new_mask] = 1
            ib.num_accepted_tokens_cpu[:num_reqs] = vals
    else:
        _ = ib.num_accepted_tokens_cpu[:num_reqs].copy()  # stale / another row's value
    return (None, None, num_reqs)


def _default_count(ri: int, step: int, k: int) -> int:
    return 1 + (ri + step) % (k + 1)


def accepted_counts_steps(rec: Any, req_ids: list[str], steps: int, mode: str, *, row_moves: bool = True,
                          k: int = 3, counts: dict[str, list[int]] | None = None, start_step: int = 0,
                          grow: dict[int, list[str]] | None = None) -> dict:
    """Steps of async spec decode on a real InputBatch. ``grow`` maps a step index to the
    request ids ``InputBatch.add_request`` adds that step (after the row moves, before the
    read): batch growth puts them in rows past the ones the last accepted-count copy wrote."""
    import torch

    _check_mode(mode)
    req_ids = list(req_ids)
    index = {r: i for i, r in enumerate(req_ids)}

    def count_of(req: str, i: int) -> int:
        if counts and req in counts and i < len(counts[req]):
            return int(counts[req][i])
        return _default_count(index[req], i, k)

    out: dict = {"reads": [], "mismatches": [], "finished": []}
    with _recording(rec):
        ib = make_input_batch(max(16, len(req_ids)), k=k)
        runner = _acc_runner(ib, k, mode)
        upd = _wrapped("accepted_counts.issue", _update_states_after_model_execute)
        prep = _wrapped("accepted_counts.read", _prepare_inputs)
        # The real GPUModelRunner._get_valid_sampled_token_count (hook-wrapped) runs on CPU:
        # it synchronizes its own event and reads valid_sampled_token_count_cpu.
        valid = _runner_method("_get_valid_sampled_token_count")
        rec.step = start_step
        for r in req_ids:
            ib.add_request(make_request_state(r, 8 + index[r]))  # live batch.add
        last_truth: dict[str, int] = {}
        for i in range(steps):
            step = start_step + i
            rec.step = step
            # _update_states: finished requests leave, condense, then the backend reorder.
            if i > 0 and row_moves:
                n = ib.num_reqs
                if i == max(1, steps // 2) and n >= 3:
                    gone = ib.req_ids[0]
                    ib.remove_request(gone)  # live batch.remove
                    ib.condense()  # live batch.condense
                    out["finished"].append(gone)
                    last_truth.pop(gone, None)
                n = ib.num_reqs
                if i % 2 == 1 and n >= 2:
                    ib.swap_states(0, n - 1)  # live batch.swap
            for r in (grow or {}).get(i, ()):
                index.setdefault(r, len(index))
                ib.add_request(make_request_state(r, 8 + index[r]))  # live batch.add past the copy's rows
                out.setdefault("grown", []).append({"step": step, "req": r, "row": ib.req_id_to_index[r]})
            with _simulated(rec):
                prep(runner, None, None)
            n = ib.num_reqs
            ids = list(ib.req_ids[:n])
            vals = ib.num_accepted_tokens_cpu[:n].tolist()
            for row, req in enumerate(ids):
                truth = last_truth.get(req) if i > 0 else None
                item = {"step": step, "req": req, "row": row, "value": int(vals[row]), "truth": truth}
                out["reads"].append(item)
                if truth is not None and int(vals[row]) != truth:
                    out["mismatches"].append(item)
            with _simulated(rec):
                valid(runner)  # acc.truth for the previous step (deferred correction)
            if mode == "buggy":
                runner.num_accepted_tokens_event.complete()  # the late copy lands now
            # sample_tokens: output ids with the step's accepted counts, then the async copies.
            c = [count_of(r, i) for r in ids]
            out_ids = torch.full((n, k + 1), -1, dtype=torch.int64)
            for row, cnt in enumerate(c):
                out_ids[row, :cnt] = 7
            valid_cpu = runner.valid_sampled_token_count_cpu
            vsrc = torch.tensor(c, dtype=torch.int32)
            runner.valid_stream.append(lambda vsrc=vsrc, n=n: valid_cpu[:n].copy_(vsrc))
            runner.valid_sampled_token_count_event.record()
            ib.prev_sampled_token_ids = torch.zeros((n, 1), dtype=torch.int64)
            ib.prev_req_id_to_index = {r: j for j, r in enumerate(ids)}
            with _simulated(rec):
                upd(runner, out_ids, None)
            last_truth = dict(zip(ids, c))
    return out
