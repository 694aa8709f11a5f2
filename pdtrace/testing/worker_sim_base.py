"""What ``worker_sim`` builds on: the recorder plumbing of a simulated worker step (events of
GPU-only steps marked ``sim: true``), the hooks' own wrappers applied to stand-in runner
methods, and a real ``NixlConnector`` (worker side) built minimally on CPU."""

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
