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

Three modules: ``worker_sim_base`` (the plumbing and the real connector), ``worker_sim_acc``
(seed 004) and this one (seeds 002 and 003); every name above is importable from here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .worker_sim_base import (  # noqa: F401 - part of this module's API
    DEFAULT_DRAFTER_LAYERS, DEFAULT_TARGET_LAYERS, MODES, _LayerStack, _SimProposer, _SimRunner, _check_mode, _live,
    _recording, _runner_method, _simulated, _wrapped, make_connector, make_metadata,
)
from .worker_sim_acc import (  # noqa: F401 - part of this module's API
    FakeCudaEvent, _acc_runner, accepted_counts_steps, make_input_batch, make_request_state,
)


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
