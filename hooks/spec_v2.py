"""Model runner V2 (``vllm/v1/worker/gpu/``, the GPU default): target / drafter phases and the
drafter's KV write windows, as ``connector_metadata`` and ``accepted_counts`` record them on V1.

Connector metadata. V2's ``gpu/kv_connector.py:ActiveKVConnector`` calls the real
``KVConnectorBase_V1`` methods (``pre_forward`` -> ``bind_connector_metadata``;
``post_forward`` -> ``wait_for_save`` + ``clear_connector_metadata`` in 0.32.0; in 0.33.0
``post_forward(defer_finalize=True)`` then ``finalize_step()`` clears), and the attention
layers ask ``has_connector_metadata`` / ``save_kv_layer`` through ``maybe_transfer_kv_layer``
on either runner. ``hooks/connector_metadata.py`` hooks those connector methods (no runner
code), so the ``kvmeta.*`` events are the same on V2; this module supplies the phases they
are stamped with (``Recorder.phase``), which V1 takes from ``GPUModelRunner._model_forward``
and ``SpecDecodeBaseProposer.propose`` -- methods V2 does not have:

- ``spec_v2.target_forward``: around V2 ``GPUModelRunner.execute_model`` (the target
  forward is inline there: the model call between ``kv_connector.pre_forward`` and
  ``finish_forward``; no narrower method brackets it). ``spec.phase`` target begin/end with
  ``runner: "v2"``. The bracket also holds the step's request-state updates and the bind
  (V1's bind is outside its phase); the metadata detector reads only the drafter phase and
  clears before it, so the wider bracket changes no verdict. Dummy / profile runs
  (``dummy_run=True``) are not steps and record nothing, nor does a call with nothing
  scheduled (``total_num_scheduled_tokens == 0``: it returns before any forward; on the H100
  run these were 1068 of P's 1093 calls).
- ``spec_v2.propose.<Class>``: around ``propose`` of every speculator class
  ``gpu/spec_decode/__init__.py:init_speculator`` builds that defines its own ``propose``
  (EAGLE / MTP / Gemma4 inherit ``TargetDependentARSpeculator.propose``; DFlash2 / DSpark /
  LiLiCorr (/ XPress in 0.33) inherit ``DFlashSpeculator.propose``). ``spec.phase`` drafter
  begin/end with ``method`` (``speculative_config.method``), the drafter's attention
  ``layers`` (``draft_attn_layer_names``) and ``runner: "v2"``. Before the phase begins, one
  ``spec.window`` per request: ``start`` = ``input_batch.seq_lens_cpu_upper_bound[row]``
  (the CPU's upper bound on the sequence after the target step, as on V1), ``end`` = start +
  ``num_query_per_req`` for the DFlash family (its query block: k+1 for DFlash, k or k+1 for
  DSpark), else ``drafter_write_len(method, k)`` (k for EAGLE / MTP / draft model, none for
  ngram and extract_hidden_states, which write no KV of their own). Rows still mid-prefill
  after this step (``num_computed_prefill_tokens + num_scheduled < prefill_len``) are left
  out, as on V1.
- ``spec_v2.init_speculator``: after ``init_speculator`` (patched where the model runner
  calls it, ``vllm.v1.worker.gpu.model_runner.init_speculator``): a speculator class whose
  ``propose`` is not one of the above (a subclass override, a new class) is patched then,
  through a dynamically registered HookSpec, so ``uninstall_all()`` restores it too.

Nothing here synchronizes: ``seq_lens_cpu_upper_bound`` is a CPU tensor and the rest are
NumPy arrays and Python lists of the InputBatch. No I/O.

Verified against vLLM 0.32.0 and 0.33.0: ``execute_model(self, scheduler_output,
intermediate_tensors=None, dummy_run=False, ...)``; every ``propose(self, input_batch,
attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=None,
dummy_run=False, ...)``; ``init_speculator(vllm_config, device, req_states)``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from pdtrace.record import recorder as _recorder
from pdtrace import schema
from pdtrace.hooks import REGISTRY, HookSpec, around, patch_after, register
from pdtrace.hooks.accepted_counts import drafter_write_len

RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
SPEC_PKG = "vllm.v1.worker.gpu.spec_decode"

# (module, class) of every speculator class in 0.32.0 / 0.33.0 that defines its own propose
SPECULATORS: tuple[tuple[str, str], ...] = (
    (f"{SPEC_PKG}.target_dependent_ar.speculator", "TargetDependentARSpeculator"),
    (f"{SPEC_PKG}.dflash.speculator", "DFlashSpeculator"),
    (f"{SPEC_PKG}.standalone_ar.speculator", "StandaloneARSpeculator"),
    (f"{SPEC_PKG}.multi_module_mtp.speculator", "MultiModuleMTPSpeculator"),
    (f"{SPEC_PKG}.ngram.speculator", "NgramGPUSpeculator"),
    (f"{SPEC_PKG}.extract_hidden_states", "ExtractHiddenStatesSpeculator"),
)
PROPOSE_PARAMS = ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
                  "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds")
_DFLASH_FAMILY = "DFlashSpeculator"

# -- target phase ----------------------------------------------------------------------------


def _target_before(rec: Any, self: Any, scheduler_output: Any, intermediate_tensors: Any = None,
                   dummy_run: bool = False, *a: Any, **kw: Any) -> Any:
    if dummy_run or getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0:
        return None  # a dummy run, or a step with nothing scheduled: execute_model runs no forward
    prev = rec.phase
    rec.phase = schema.PHASE_TARGET
    rec.put("spec.phase", None, None, {"phase": schema.PHASE_TARGET, "edge": "begin", "runner": "v2"})
    return (prev,)


def _phase_after(phase: str) -> Callable[..., None]:
    def after_fn(rec: Any, state: Any, result: Any, *a: Any, **kw: Any) -> None:
        if not isinstance(state, tuple):
            return  # skipped call (dummy run) or a before that failed: nothing was opened
        rec.put("spec.phase", None, None, {"phase": phase, "edge": "end", "runner": "v2"})
        rec.phase = state[0] if isinstance(state[0], str) else ""

    return after_fn


TARGET = register(
    "spec_v2.target_forward", RUNNER_MODULE, "GPUModelRunner.execute_model",
    ("scheduler_output", "intermediate_tensors", "dummy_run"),
    around("spec_v2.target_forward", _target_before, _phase_after(schema.PHASE_TARGET),
           skip="dummy_run or getattr(scheduler_output, 'total_num_scheduled_tokens', None) == 0"),
    doc="spec.phase target begin/end (V2); sets Recorder.phase", runner="v2")

# -- drafter phase and windows ------------------------------------------------------------------


def _layers(self: Any) -> list[str] | None:
    names = getattr(self, "draft_attn_layer_names", None)
    if not names:
        return None
    cached = self.__dict__.get("_pdtrace_layers")
    if cached is None or len(cached) != len(names):
        cached = sorted(names)
        self.__dict__["_pdtrace_layers"] = cached
    return cached


def _write_len(self: Any, method: str, k: int) -> int | None:
    if any(c.__name__ == _DFLASH_FAMILY for c in type(self).__mro__):
        q = int(getattr(self, "num_query_per_req", 0) or 0)
        return q if q > 0 else None
    return drafter_write_len(method, k)


def window_rows(ib: Any) -> list[tuple[str, int]]:
    """(request, start) for the rows of a V2 InputBatch whose request sampled this step."""
    n = int(ib.num_reqs)
    ids = ib.req_ids[:n]
    seq = ib.seq_lens_cpu_upper_bound[:n].tolist()  # CPU tensor: no device sync
    done = getattr(ib, "num_computed_prefill_tokens_np", None)
    plen = getattr(ib, "prefill_len_np", None)
    sched = getattr(ib, "num_scheduled_tokens", None)
    out = []
    for row, req in enumerate(ids):
        if done is not None and plen is not None and sched is not None \
                and int(done[row]) + int(sched[row]) < int(plen[row]):
            continue  # mid-prefill: nothing sampled this step
        out.append((req, int(seq[row])))
    return out


def _drafter_before(rec: Any, self: Any, input_batch: Any, attn_metadata: Any = None, slot_mappings: Any = None,
                    last_hidden_states: Any = None, aux_hidden_states: Any = None, num_sampled: Any = None,
                    num_rejected: Any = None, last_sampled: Any = None, next_prefill_tokens: Any = None,
                    temperature: Any = None, seeds: Any = None, dp_sync_state: Any = None, dummy_run: bool = False,
                    skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None, is_profile: bool = False,
                    num_speculative_tokens: int | None = None, *a: Any, **kw: Any) -> Any:
    # the real parameter list, so the signature-exact wrapper passes every argument straight through
    if dummy_run:
        return None
    cfg = getattr(self, "speculative_config", None)
    method = str(getattr(cfg, "method", "") or getattr(self, "method", "") or "")
    k = num_speculative_tokens
    if k is None:
        k = getattr(self, "num_speculative_steps", 0)
    n = _write_len(self, method, int(k or 0))
    if n is not None:
        for req, start in window_rows(input_batch):
            rec.put("spec.window", req, None, {"start": start, "end": start + n, "method": method})
    prev = rec.phase
    rec.phase = schema.PHASE_DRAFTER
    fields: dict[str, Any] = {"method": method, "runner": "v2"}
    layers = _layers(self)
    if layers:
        fields["layers"] = layers
    rec.put("spec.phase", None, None, {"phase": schema.PHASE_DRAFTER, "edge": "begin", **fields})
    return (prev,)


_drafter_after = _phase_after(schema.PHASE_DRAFTER)


def _propose_wrap(hook: str) -> Callable[[Callable], Callable]:
    return around(hook, _drafter_before, _drafter_after, skip="dummy_run")


def _propose_name(module: str, cls: str) -> str:
    return f"spec_v2.propose.{cls}"  # run-time ones (below) are "spec_v2.propose[module.Class]"


# Where a release lays the same speculator out elsewhere (same propose parameters): EAGLE / MTP
# were AutoRegressiveSpeculator (0.23.0-0.31.x) and EagleSpeculator (0.22.x) before the rename.
_SPECULATOR_LAYOUTS: dict[str, tuple[tuple[str, str, tuple[str, ...], str], ...]] = {
    "TargetDependentARSpeculator": (
        (f"{SPEC_PKG}.autoregressive.speculator", "AutoRegressiveSpeculator.propose", PROPOSE_PARAMS,
         "0.23.0-0.31.x"),
        (f"{SPEC_PKG}.eagle.speculator", "EagleSpeculator.propose", PROPOSE_PARAMS, "0.22.x")),
}
# Only the EAGLE/MTP family is in every release with V2 speculative decoding; each other class is
# in some releases only (DFlash from 0.24.0, ...): absent, it is optional, and whatever
# init_speculator builds is patched at run time anyway (spec_v2.init_speculator below).
PROPOSE: dict[str, HookSpec] = {
    cls: register(_propose_name(mod, cls), mod, f"{cls}.propose", PROPOSE_PARAMS,
                  _propose_wrap(_propose_name(mod, cls)),
                  doc=f"spec.window per request + spec.phase drafter begin/end ({cls}, V2)", runner="v2",
                  optional=cls not in _SPECULATOR_LAYOUTS, layouts=_SPECULATOR_LAYOUTS.get(cls, ()))
    for mod, cls in SPECULATORS
}

# -- safety net: whatever init_speculator built has a hooked propose --------------------------

_patch_lock = threading.Lock()


def patch_speculator_class(klass: type) -> str | None:
    """Patch the ``propose`` that ``klass`` resolves to when it is not hooked yet; the new hook's name."""
    with _patch_lock:
        for owner in klass.__mro__:
            fn = vars(owner).get("propose")
            if fn is None:
                continue
            if getattr(fn, "__pdtrace_hook__", None) or getattr(fn, "__isabstractmethod__", False):
                return None
            name = f"spec_v2.propose[{owner.__module__}.{owner.__qualname__}]"
            spec = register(name, owner.__module__, f"{owner.__qualname__}.propose", PROPOSE_PARAMS,
                            _propose_wrap(name), doc="spec.window + spec.phase drafter (found at run time)",
                            optional=True, runner="v2")
            spec.subsystem = "spec_v2"
            setattr(owner, "propose", spec.wrap(fn))
            spec.owner, spec.original, spec.status, spec.reason = owner, fn, "applied", ""
            break
        else:
            return None
    rec = _recorder.get()
    if rec is not None:
        from pdtrace.hooks import _report_status

        _report_status()
    return name


def _patch_speculator(result: Any, *args: Any, **kwargs: Any) -> None:
    if result is not None:
        patch_speculator_class(type(result))


INIT_SPECULATOR = register(
    "spec_v2.init_speculator", RUNNER_MODULE, "init_speculator", ("vllm_config", "device", "req_states"),
    patch_after("spec_v2.init_speculator", _patch_speculator), doc="patch the propose of a speculator class not listed in SPECULATORS", runner="v2",
    layouts=((RUNNER_MODULE, "init_speculator", ("vllm_config", "device"), "0.22.1-0.25.x"),))


def dynamic_specs() -> list[HookSpec]:
    return [s for n, s in REGISTRY.items() if n.startswith("spec_v2.propose[")]


SPECS = (TARGET, *PROPOSE.values(), INIT_SPECULATOR)
