"""Documented simulation of the vLLM worker side, driven THROUGH pdtrace's worker hooks.

The worker-side code that bug classes 002/003/004 live in (the target forward, the drafter's
propose, the accepted-count D2H copy and its CUDA event) needs a GPU and a loaded model.
This module reproduces the calls those vLLM 0.32.0 methods make, in the same order, on CPU,
so CPU-only traces (scenario samples) can contain worker events.

Which events are live and which are simulated
---------------------------------------------
- LIVE-ON-CPU (no ``sim`` field): events recorded by a pdtrace hook wrapping REAL vLLM
  code that really ran here: ``batch.*`` from a real ``InputBatch`` built on CPU, and
  ``kvmeta.*`` from a real ``NixlConnector`` instance (``bind/clear/has`` are the base-class
  methods, ``save_kv_layer``/``wait_for_save`` are NixlBaseConnector's). The ORDER of those
  calls is the simulation's (the model runner's call sequence), and the ``phase`` field they
  carry comes from the simulated phases. The trace header's ``origin`` ('scenario') says
  the worker side was simulated.
- SIMULATED (``sim: true``): events recorded by the same hooks wrapped around minimal
  faithful callers that stand in for GPU-only GPUModelRunner / proposer methods:
  ``spec.phase``, ``d2h.issue``, ``d2h.done``, ``acc.read``, ``acc.truth``, ``spec.window``.
  Where the real method body runs on CPU it is used, with a stand-in ``self``
  (``GPUModelRunner._model_forward``, ``GPUModelRunner._get_valid_sampled_token_count``);
  ``_prepare_inputs``, ``_update_states_after_model_execute`` (whose D2H copy must stay in
  flight, which a CPU ``copy_`` cannot) and ``propose*`` are faithful minimal callers.
  The CUDA event is ``FakeCudaEvent`` (record/query/synchronize; a recorded copy lands
  only when the runner synchronizes or the simulation completes it).

The recorder
------------
Every function takes ``rec``, a ``pdtrace.record.recorder.Recorder`` (normally
``Recorder.in_memory(role="worker", inst="P"|"D")``, one per simulated worker, kept apart
from the engine-core recorder so events get the worker role). The function makes ``rec``
the current recorder while it runs (hooks emit into the current recorder), sets
``rec.step`` to each simulated step (events carry ``step``), and restores both afterwards.
The worker hooks (``connector_metadata``, ``accepted_counts``, ``input_batch``) are
installed with ``install_now()`` if they are not yet applied; they stay installed.

API (plain inputs, plain outputs)
---------------------------------
``connector_metadata_steps(rec, req_ids, steps, mode, *, target_layers=None,
drafter_layers=None, method="eagle", start_step=0) -> dict``
    Seed 002. Per step: bind (metadata naming ``req_ids``) -> target phase (per layer:
    has -> save_layer) -> [buggy: wait_for_save + clear, as the old runner did when the
    connector context manager exited after the target forward] -> drafter phase (per
    layer: has; save_layer only if has was True) -> [fixed: wait_for_save + clear, as
    0.32.0's finalize_kv_connector after propose]. Layers default to
    ``model.layers.{0,1}.self_attn.attn`` and ``draft_model.layers.0.self_attn.attn``.
    Returns ``{"steps": [...], "saved": {"target": n, "drafter": n}, "has_false": {"target": n,
    "drafter": n}}``.

``accepted_counts_steps(rec, req_ids, steps, mode, *, row_moves=True, k=3, counts=None,
start_step=0) -> dict``
    Seed 004. Async spec decode (MTP, hybrid model) with ``req_ids`` in a real CPU
    InputBatch. Step s: [s>0 and row_moves: remove+condense (once, middle step, >=3
    requests) and swap_states(0, last) (odd steps)] -> ``_prepare_inputs`` (acc.read per
    row) -> ``_get_valid_sampled_token_count`` (acc.truth for step s-1) -> sample ->
    ``_update_states_after_model_execute`` (d2h.issue, copy in flight) -> [buggy: the copy
    lands only after the next read]. Fixed = 0.32.0's CPU-read path (``event.synchronize()``
    then read through the prev-row mapping: value == truth, synced). Buggy = the race of
    vLLM PR #45100: no wait, rows read where the request sits now (stale value, or another
    request's value after a row move), event_done False, synced False.
    ``counts`` (optional) = ``{req_id: [accepted count at step 0, 1, ...]}``; default
    ``1 + (request index + step) % (k + 1)``. Returns ``{"reads": [{"step", "req", "row",
    "value", "truth"}...], "mismatches": [same, where value != truth], "finished": [req ids
    removed by the row moves]}`` (truth None where there is no previous step).

``drafter_window(rec, req_ids, prompt_lens, mode, *, method="dflash", k=3, step=0,
block_ids=None, block_size=16) -> list[dict]``
    Seed 003. The drafter's KV write window right after the first (full) prefill:
    ``[prompt_len, prompt_len + n)`` with n = k+1 for dflash, k for eagle/eagle3/mtp/
    draft_model (``pdtrace.hooks.accepted_counts.drafter_write_len``). The worker writes
    the same window in both modes (the bug is the scheduler's reservation, recorded by the
    scheduler hooks); ``mode`` is accepted for symmetry. With ``block_ids`` (per request:
    a list of block ids, group 0) the result also says which positions fall past the
    allocation. Returns ``[{"req", "start", "end", "blocks_needed", "blocks_held",
    "overflow_positions"}]``.

``mode`` is ``"fixed"`` or ``"buggy"`` everywhere.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

from pdtrace.record import recorder as _recorder

MODES = ("fixed", "buggy")

DEFAULT_TARGET_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
DEFAULT_DRAFTER_LAYERS = ("draft_model.layers.0.self_attn.attn",)


# ---------------------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------------------

class _SimRecorder:
    """Recorder view that adds ``sim=True`` to every event (shares phase/step with the real one)."""

    def __init__(self, rec: Any) -> None:
        object.__setattr__(self, "_rec", rec)

    def emit(self, kind: str, req: str | None = None, step: int | None = None, **fields: Any) -> None:
        fields["sim"] = True
        self._rec.emit(kind, req=req, step=step, **fields)

    def put(self, kind: str, req: str | None, step: int | None, fields: dict[str, Any]) -> None:
        fields["sim"] = True
        self._rec.put(kind, req, step, fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rec, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._rec, name, value)


@contextlib.contextmanager
def _recording(rec: Any) -> Iterator[None]:
    _ensure_hooks()
    prev = _recorder.set_current(rec)
    step0, phase0 = rec.step, rec.phase
    try:
        yield
    finally:
        rec.step, rec.phase = step0, phase0
        _recorder.set_current(prev)


@contextlib.contextmanager
def _simulated(rec: Any) -> Iterator[None]:
    """Inside: hook events are marked sim=True (a faithful caller stands in for GPU code)."""
    prev = _recorder.set_current(_SimRecorder(rec))
    try:
        yield
    finally:
        _recorder.set_current(prev)


def _ensure_hooks() -> None:
    from pdtrace import hooks
    from pdtrace.hooks import accepted_counts, connector_metadata, input_batch

    specs = (*connector_metadata.SPECS, *accepted_counts.SPECS, *input_batch.SPECS)
    if any(s.status != "applied" and not s.optional for s in specs):
        hooks.install_now()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _runner_method(name: str) -> Any:
    """The real (hook-wrapped) ``GPUModelRunner.<name>``, called with a stand-in ``self``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return getattr(GPUModelRunner, name)


def _wrapped(spec_name: str, fn: Any) -> Any:
    """``fn`` wrapped by the registered hook ``spec_name`` (the same wrapper vLLM gets)."""
    from pdtrace.hooks import REGISTRY

    return REGISTRY[spec_name].wrap(fn)


# ---------------------------------------------------------------------------------------
# a real NixlConnector, built minimally on CPU
# ---------------------------------------------------------------------------------------

def make_connector(kv_role: str = "kv_producer") -> Any:
    """A real ``NixlConnector`` (NixlPullConnector) instance without a NIXL agent.

    Runs the real ``KVConnectorBase_V1.__init__`` (which pdtrace's connector_init hook wraps,
    patching NixlBaseConnector's overrides) with a config that carries only the
    kv_transfer_config it reads; ``connector_worker`` is a stand-in whose host-buffer flags
    are off, so the real ``wait_for_save`` does nothing, as for a GPU-direct NIXL worker.
    """
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    conn = object.__new__(NixlConnector)
    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role))
    KVConnectorBase_V1.__init__(conn, cfg, KVConnectorRole.WORKER, None)
    conn.connector_scheduler = None
    conn.connector_worker = SimpleNamespace(use_host_buffer=False, copy_blocks=None)
    return conn


def make_metadata(req_ids: list[str], *, send: bool = True) -> Any:
    """A real ``NixlConnectorMetadata`` naming ``req_ids`` (P side: reqs_to_send; else reqs_to_recv keys)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    md = NixlConnectorMetadata()
    for r in req_ids:
        if send:
            md.reqs_to_send[r] = 0.0
        else:
            md.reqs_to_recv[r] = None  # the bind hook only counts / names them
    return md


class _LayerStack:
    """Stand-in for a model whose attention layers carry ``maybe_transfer_kv_layer``.

    Per layer it makes the decorator's calls (kv_transfer_utils.py in 0.32.0): skip when
    ``not connector.has_connector_metadata()``, else ``wait_for_layer_load(name)``, the
    layer, ``save_kv_layer(name, kv_cache, attn_metadata)``.
    """

    def __init__(self, connector: Any, layers: tuple[str, ...], saved: list[str], skipped: list[str]) -> None:
        self.connector, self.layers, self.saved, self.skipped = connector, layers, saved, skipped

    def __call__(self, *a: Any, **kw: Any) -> str:
        c = self.connector
        with _live():
            for name in self.layers:
                if not c.has_connector_metadata():
                    self.skipped.append(name)
                    continue
                c.wait_for_layer_load(name)
                c.save_kv_layer(name, None, None)
                self.saved.append(name)
        return "hidden_states"


@contextlib.contextmanager
def _live() -> Iterator[None]:
    """Inside a simulated caller: calls into real vLLM code record live (no sim flag)."""
    cur = _recorder.get()
    real = cur._rec if isinstance(cur, _SimRecorder) else cur
    prev = _recorder.set_current(real)
    try:
        yield
    finally:
        _recorder.set_current(prev)


class _SimRunner:
    """Faithful minimal stand-in for the GPUModelRunner methods the hooks wrap."""


class _SimProposer:
    def __init__(self, method: str, layers: tuple[str, ...]) -> None:
        self.method = method
        self._draft_attn_layer_names = set(layers)


# ---------------------------------------------------------------------------------------
# (a) seed 002: connector metadata lifecycle around target and drafter
# ---------------------------------------------------------------------------------------

def connector_metadata_steps(rec: Any, req_ids: list[str], steps: int, mode: str, *,
                             target_layers: tuple[str, ...] | list[str] | None = None,
                             drafter_layers: tuple[str, ...] | list[str] | None = None,
                             method: str = "eagle", start_step: int = 0) -> dict:
    _check_mode(mode)
    tl = tuple(target_layers or DEFAULT_TARGET_LAYERS)
    dl = tuple(drafter_layers or DEFAULT_DRAFTER_LAYERS)
    out: dict = {"steps": [], "saved": {"target": 0, "drafter": 0}, "has_false": {"target": 0, "drafter": 0}}
    with _recording(rec):
        conn = make_connector()
        md = make_metadata(list(req_ids))

        saved: dict[str, list[str]] = {"target": [], "drafter": []}
        skipped: dict[str, list[str]] = {"target": [], "drafter": []}
        runner = _SimRunner()
        runner.model = _LayerStack(conn, tl, saved["target"], skipped["target"])

        proposer = _SimProposer(method, dl)
        drafter_model = _LayerStack(conn, dl, saved["drafter"], skipped["drafter"])

        def propose(self: Any, num_speculative_tokens: Any, target_token_ids: Any, target_positions: Any,
                    target_hidden_states: Any, next_token_ids: Any, *a: Any, **kw: Any) -> Any:
            return drafter_model()  # the drafter's forward(s) inside set_forward_context

        # The real GPUModelRunner._model_forward (hook-wrapped): it only calls self.model(...).
        target_forward = _runner_method("_model_forward")
        drafter_propose = _wrapped("connector_metadata.drafter_propose", propose)

        for i in range(steps):
            step = start_step + i
            rec.step = step
            conn.bind_connector_metadata(md)  # live: maybe_get_kv_connector_output enter
            with _simulated(rec):
                target_forward(runner)
            if mode == "buggy":  # old runner: context manager exit finalized right after the target
                conn.wait_for_save()
                conn.clear_connector_metadata()
            with _simulated(rec):
                drafter_propose(proposer, 3, None, None, None, None)
            if mode == "fixed":  # 0.32.0: finalize_kv_connector() after propose_draft_token_ids
                conn.wait_for_save()
                conn.clear_connector_metadata()
            out["steps"].append(step)
        for ph in ("target", "drafter"):
            out["saved"][ph] = len(saved[ph])
            out["has_false"][ph] = len(skipped[ph])
    return out


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


# ---------------------------------------------------------------------------------------
# (c) seed 003: the drafter's KV write window after the first prefill
# ---------------------------------------------------------------------------------------

def _propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                             hidden_states: Any, sample_hidden_states: Any, aux_hidden_states: Any,
                             spec_decode_metadata: Any, common_attn_metadata: Any, slot_mappings: Any) -> list:
    return [[0] * self.speculative_config.num_speculative_tokens for _ in range(self.input_batch.num_reqs)]


def drafter_window(rec: Any, req_ids: list[str], prompt_lens: list[int], mode: str, *, method: str = "dflash",
                   k: int = 3, step: int = 0, block_ids: dict[str, list[int]] | None = None,
                   block_size: int = 16) -> list[dict]:
    import numpy as np
    import torch

    from pdtrace.hooks.accepted_counts import drafter_write_len

    _check_mode(mode)
    n = drafter_write_len(method, k)
    out: list[dict] = []
    with _recording(rec):
        rec.step = step
        ib = make_input_batch(max(16, len(req_ids)), k=k, block_size=block_size,
                              max_model_len=max(1024, max(prompt_lens) + k + 1 + block_size))
        for r, plen in zip(req_ids, prompt_lens):
            ib.add_request(make_request_state(r, plen, (block_ids or {}).get(r)))  # live batch.add
        runner = _SimRunner()
        runner.input_batch = ib
        runner.speculative_config = SimpleNamespace(method=method, num_speculative_tokens=k)
        runner.discard_request_mask = SimpleNamespace(np=np.zeros(ib.max_num_reqs, dtype=bool))
        # After a full first prefill, the target's sequence length is the prompt length.
        cad = SimpleNamespace(seq_lens_cpu_upper_bound=torch.tensor(list(prompt_lens), dtype=torch.int32))
        sched = SimpleNamespace(num_scheduled_tokens=dict(zip(req_ids, prompt_lens)))
        propose = _wrapped("accepted_counts.window", _propose_draft_token_ids)
        with _simulated(rec):
            propose(runner, sched, None, None, None, None, None, None, cad, None)
    if n is None:
        return out
    for r, plen in zip(req_ids, prompt_lens):
        start, end = plen, plen + n
        held = list((block_ids or {}).get(r, []))
        need = (end + block_size - 1) // block_size
        overflow = [p for p in range(start, end) if p // block_size >= len(held)] if block_ids is not None else []
        out.append({"req": r, "start": start, "end": end, "blocks_needed": need, "blocks_held": len(held),
                    "overflow_positions": overflow})
    return out
