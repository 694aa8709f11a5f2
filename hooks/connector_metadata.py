"""Hooks on the worker-side KV connector's metadata lifecycle and on the model phases.

Bug class 002: ``clear_connector_metadata()`` ran after the target forward but before the
drafter forward, so ``has_connector_metadata()`` was False during the drafter's attention
layers and their ``save_kv_layer`` never ran. To see that from a trace, every connector
metadata call is recorded with the model phase it happened in:

- ``kvmeta.bind``  ``KVConnectorBase_V1.bind_connector_metadata(connector_metadata)``
- ``kvmeta.clear`` ``KVConnectorBase_V1.clear_connector_metadata()``
- ``kvmeta.has``   ``KVConnectorBase_V1.has_connector_metadata()`` (asked per attention
  layer by ``model_executor/layers/attention/kv_transfer_utils.py:maybe_transfer_kv_layer``)
- ``kvmeta.save_layer`` ``save_kv_layer(layer_name, kv_layer, attn_metadata)``
- ``kvmeta.wait_for_save`` ``wait_for_save()``
- ``spec.phase`` begin/end around the target forward (``GPUModelRunner._model_forward``,
  the narrowest method that brackets only the target model call; ``execute_model`` also
  binds metadata and starts loads) and around the drafter
  (``SpecDecodeBaseProposer.propose``, which EagleProposer / DFlashProposer /
  DraftModelProposer inherit in 0.32.0; ``Step3p5MTPProposer.propose`` overrides it).
  The phase is also kept in ``Recorder.phase`` so kvmeta events carry it.

Subclass overrides. ``save_kv_layer`` and ``wait_for_save`` are abstract on
``KVConnectorBase_V1``: every real connector overrides them (NixlBaseConnector does), and
MultiConnector overrides bind/clear too, so patching the base class alone would miss
them. We therefore also hook ``KVConnectorBase_V1.__init__``: when a connector is
constructed (the worker builds it after pdtrace installed its hooks), every class in its
MRO that defines one of these methods in its own ``__dict__`` is patched too, each through
a dynamically registered HookSpec, so ``uninstall_all()`` restores it like any other hook.
``patch_connector_class(cls)`` does the same on demand (for a connector built before the
hooks were installed). A re-entrancy guard keeps one event per outer call when an
override calls ``super()`` or a MultiConnector forwards to its children.

Cost. ``has_connector_metadata`` runs once per attention layer per forward, so its
wrapper is hand-written: one global read when not recording, one thread-local read, the
original call and one ``emit``. No CUDA call, no I/O.

Live on CPU: the connector methods are plain Python and run on CPU (tests call a real
NixlConnector instance). ``_model_forward`` and ``propose`` need a loaded model: live on a
GPU worker and on vLLM's CPU worker (``CPUModelRunner`` subclasses GPUModelRunner), tested
here against the real signatures with a faithful minimal caller.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from pdtrace.record import recorder as _recorder
from pdtrace import schema
from pdtrace.hooks import REGISTRY, HookSpec, around, patch_after, register

BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
BASE_CLASS = "KVConnectorBase_V1"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
PROPOSER_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
STEP3P5_MODULE = "vllm.v1.spec_decode.step3p5"

_tls = threading.local()


def _guarded(hook: str, orig: Callable, record: Callable[..., None]) -> Callable:
    """Wrapper for a connector method: original first, then ``record(rec, result, self, *args)``.

    Records only the outermost call on this thread (super() chains, MultiConnector fan-out).
    """

    @functools.wraps(orig)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _recorder._current is None or getattr(_tls, "busy", False):
            return orig(self, *args, **kwargs)
        _tls.busy = True
        try:
            result = orig(self, *args, **kwargs)
        finally:
            _tls.busy = False
        rec = _recorder._current
        if rec is not None:
            try:
                record(rec, result, self, *args, **kwargs)
            except Exception as exc:  # never into vLLM
                rec.hook_error(hook, exc)
        return result

    wrapper.__pdtrace_hook__ = hook  # type: ignore[attr-defined]
    return wrapper


# -- recording bodies ------------------------------------------------------------------

def _count(md: Any, attr: str) -> int:
    v = getattr(md, attr, None)
    try:
        return len(v) if v is not None else 0
    except TypeError:
        return 0


def _rec_bind(rec: Any, result: Any, self: Any, md: Any, *a: Any, **kw: Any) -> None:
    reqs: set[str] = set()
    for attr in ("reqs_to_recv", "reqs_to_save", "reqs_to_send"):
        v = getattr(md, attr, None)
        if isinstance(v, dict):
            reqs.update(str(k) for k in v)
    rec.put("kvmeta.bind", None, None, {
        "connector": type(self).__name__, "n_recv": _count(md, "reqs_to_recv"), "n_save": _count(md, "reqs_to_save"),
        "n_send": _count(md, "reqs_to_send"), "reqs": sorted(reqs)})


def _rec_clear(rec: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    rec.put("kvmeta.clear", None, None, {"phase": rec.phase})


def _rec_has(rec: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    rec.put("kvmeta.has", None, None, {"result": bool(result), "phase": rec.phase})


def _rec_save(rec: Any, result: Any, self: Any, layer_name: Any = "", *a: Any, **kw: Any) -> None:
    rec.put("kvmeta.save_layer", None, None, {"layer": str(kw.get("layer_name", layer_name)), "phase": rec.phase})


def _rec_wait(rec: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    rec.put("kvmeta.wait_for_save", None, None, {"phase": rec.phase})


# method -> (short hook name, expected params, record fn)
METHODS: dict[str, tuple[str, tuple[str, ...], Callable[..., None]]] = {
    "bind_connector_metadata": ("bind", ("connector_metadata",), _rec_bind),
    "clear_connector_metadata": ("clear", (), _rec_clear),
    "has_connector_metadata": ("has", (), _rec_has),
    "save_kv_layer": ("save_layer", ("layer_name", "kv_layer", "attn_metadata"), _rec_save),
    "wait_for_save": ("wait_for_save", (), _rec_wait),
}


def _wrap_for(method: str) -> Callable[[Callable], Callable]:
    short, _params, record = METHODS[method]
    hook = f"connector_metadata.{short}"
    return lambda orig: _guarded(hook, orig, record)


BASE_SPECS: dict[str, HookSpec] = {
    method: register(f"connector_metadata.{short}", BASE_MODULE, f"{BASE_CLASS}.{method}", params,
                     _wrap_for(method), doc=f"kvmeta.{short}")
    for method, (short, params, _r) in METHODS.items()
}


# -- per-subclass patching ------------------------------------------------------------

_patch_lock = threading.Lock()


def patch_connector_class(cls: type) -> list[str]:
    """Patch every override of the metadata methods in ``cls``'s MRO. Returns new hook names.

    Each patch is a HookSpec in the registry (status 'applied', owner = the defining class),
    so ``uninstall_all()`` restores the original and ``hooks.status`` lists it.
    """
    new: list[str] = []
    with _patch_lock:
        for klass in cls.__mro__:
            if klass.__name__ == BASE_CLASS or klass is object:
                continue
            own = vars(klass)
            for method, (short, params, _r) in METHODS.items():
                fn = own.get(method)
                if fn is None or not callable(fn) or getattr(fn, "__pdtrace_hook__", None):
                    continue
                name = f"connector_metadata.{short}[{klass.__module__}.{klass.__qualname__}]"
                spec = register(name, klass.__module__, f"{klass.__qualname__}.{method}", params,
                                _wrap_for(method), doc=f"kvmeta.{short} (override)", optional=True)
                spec.subsystem = "connector_metadata"
                setattr(klass, method, spec.wrap(fn))
                spec.owner, spec.original, spec.status, spec.reason = klass, fn, "applied", ""
                new.append(name)
    if new:
        rec = _recorder.get()
        if rec is not None:
            from pdtrace.hooks import _report_status

            _report_status()
    return new


def _rec_connector_init(rec: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    patch_connector_class(type(self))


def _patch_connector(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    # Not through after(): the class must be patched even when no recorder is active yet,
    # because recording may start later while the connector lives on.
    patch_connector_class(type(self))


INIT_SPEC = register("connector_metadata.connector_init", BASE_MODULE, f"{BASE_CLASS}.__init__",
                     ("vllm_config", "role", "kv_cache_config"),
                     patch_after("connector_metadata.connector_init", _patch_connector),
                     doc="patch connector subclasses that override the metadata methods")


def dynamic_specs() -> list[HookSpec]:
    return [s for n, s in REGISTRY.items() if n.startswith("connector_metadata.") and "[" in n]


# -- phases ----------------------------------------------------------------------------

def _phase_begin(phase: str, method: str = "", layers: list[str] | None = None) -> Callable[..., str]:
    def before(rec: Any, *a: Any, **kw: Any) -> str:
        prev = rec.phase
        rec.phase = phase
        fields: dict[str, Any] = {}
        if method:
            fields["method"] = method
        if layers:
            fields["layers"] = layers
        rec.put("spec.phase", None, None, {"phase": phase, "edge": "begin", **fields})
        return prev

    return before


_begin_target = _phase_begin(schema.PHASE_TARGET)


def _target_before(rec: Any, self: Any, *a: Any, **kw: Any) -> str:
    return _begin_target(rec)


def _phase_end(phase: str) -> Callable[..., None]:
    def after_fn(rec: Any, prev: Any, result: Any, *a: Any, **kw: Any) -> None:
        rec.put("spec.phase", None, None, {"phase": phase, "edge": "end"})
        rec.phase = prev if isinstance(prev, str) else ""

    return after_fn


def _drafter_layers(self: Any) -> list[str] | None:
    names = getattr(self, "_draft_attn_layer_names", None)
    if not names:
        return None
    cached = getattr(self, "_pdtrace_layers", None)
    if cached is None or len(cached) != len(names):
        cached = sorted(names)
        try:
            self._pdtrace_layers = cached
        except Exception:
            pass
    return cached


def _drafter_before(rec: Any, self: Any, *a: Any, **kw: Any) -> str:
    return _phase_begin(schema.PHASE_DRAFTER, str(getattr(self, "method", "") or ""), _drafter_layers(self))(rec)


TARGET_SPEC = register(
    "connector_metadata.target_forward", RUNNER_MODULE, "GPUModelRunner._model_forward",
    ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
    around("connector_metadata.target_forward", _target_before, _phase_end(schema.PHASE_TARGET)),
    doc="spec.phase target begin/end; sets Recorder.phase", runner="v1")

_PROPOSE_PARAMS = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                   "next_token_ids")
DRAFTER_SPEC = register(
    "connector_metadata.drafter_propose", PROPOSER_MODULE, "SpecDecodeBaseProposer.propose", _PROPOSE_PARAMS,
    around("connector_metadata.drafter_propose", _drafter_before, _phase_end(schema.PHASE_DRAFTER)),
    doc="spec.phase drafter begin/end (EAGLE, DFlash, draft model)", runner="v1",
    layouts=((PROPOSER_MODULE, "SpecDecodeBaseProposer.propose", _PROPOSE_PARAMS[1:], "0.22.1-0.23.0 (no k)"),
             ("vllm.v1.spec_decode.eagle", "EagleProposer.propose", _PROPOSE_PARAMS[1:],
              "0.19.x-0.21.x (no llm_base_proposer yet)")))
DRAFTER_STEP3P5_SPEC = register(
    "connector_metadata.drafter_propose_step3p5", STEP3P5_MODULE, "Step3p5MTPProposer.propose", _PROPOSE_PARAMS,
    around("connector_metadata.drafter_propose_step3p5", _drafter_before, _phase_end(schema.PHASE_DRAFTER)),
    doc="spec.phase drafter begin/end (Step3p5 MTP overrides propose)", optional=True, runner="v1",
    layouts=((STEP3P5_MODULE, "Step3p5MTPProposer.propose", _PROPOSE_PARAMS[1:], "0.22.1-0.23.0 (no k)"),))

SPECS = (*BASE_SPECS.values(), INIT_SPEC, TARGET_SPEC, DRAFTER_SPEC, DRAFTER_STEP3P5_SPEC)
