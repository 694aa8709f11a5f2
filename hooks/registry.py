"""The per-hook registry: every hook is a ``HookSpec``, declared by its subsystem module with
``register(...)`` at import (``pdtrace.hooks.install`` patches them; ``pdtrace.hooks.wrappers``
builds the recording wrappers). No vLLM import."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

SUBSYSTEMS = ("scheduler", "nixl", "kv_load", "connector_metadata", "accepted_counts", "input_batch", "worker", "runner",
              "spec_v2", "states_v2")


@dataclasses.dataclass
class HookSpec:
    name: str  # e.g. "scheduler.schedule"
    module: str  # e.g. "vllm.v1.core.sched.scheduler"
    qualname: str  # e.g. "Scheduler.schedule"
    params: tuple[str, ...]  # expected leading parameter names (after self)
    wrap: Callable[[Callable], Callable]
    subsystem: str = ""
    doc: str = ""
    optional: bool = False  # absent in some vLLM layouts: skipped without being a failure
    # which model runner's code the target lives in: "v1" (vllm/v1/worker/gpu_model_runner.py and
    # what only it calls), "v2" (vllm/v1/worker/gpu/), "" (not runner code: it fires whichever runs)
    runner: str = ""
    # other releases' forms of the same target, tried in order after (module, qualname, params):
    # each (module, qualname, params) with a note of the releases it is; the hook's body reads only
    # what every form passes in the same position. The first form that resolves is patched.
    layouts: tuple[tuple[str, str, tuple[str, ...], str], ...] = ()
    # a layout whose arguments differ in position has its own recording wrap, keyed by the whole form
    # (module, qualname, params): two releases may lay the same method out with different parameters
    layout_wraps: dict = dataclasses.field(default_factory=dict)
    # runtime state
    status: str = "pending"  # pending | applied | skipped
    reason: str = ""
    original: Any = None
    owner: Any = None
    applied_form: "tuple[str, str, tuple[str, ...]] | None" = None  # the form patched (module, qualname, params)
    where: str = ""  # the patched function's source, "vllm/PATH.py:LINE QUALNAME" (hooks.status ``where``)

    def forms(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(module, qualname, params) for the primary target, then each other release's layout."""
        return [(self.module, self.qualname, self.params)] + [tuple(f[:3]) for f in self.layouts]  # type: ignore[misc]


REGISTRY: dict[str, HookSpec] = {}
_lock = threading.RLock()
_armed: dict[str, list[tuple[HookSpec, tuple]]] = {}  # module name -> (spec, form) waiting for its import


def register(name: str, module: str, qualname: str, params: tuple[str, ...], wrap: Callable[[Callable], Callable],
             *, doc: str = "", optional: bool = False, runner: str = "",
             layouts: tuple[tuple, ...] = ()) -> HookSpec:
    """Declare a hook. ``layouts``: the same target as other vLLM releases lay it out, each
    ``(module, qualname, params, releases)`` or ``(..., releases, wrap)`` when that form's
    arguments need their own recording wrap; tried in order after the primary one."""
    sub = name.split(".", 1)[0]
    spec = HookSpec(name, module, qualname, tuple(params), wrap, sub, doc, optional, runner,
                    tuple((lay[0], lay[1], tuple(lay[2]), lay[3]) for lay in layouts),
                    {(lay[0], lay[1], tuple(lay[2])): lay[4] for lay in layouts if len(lay) > 4})
    REGISTRY[name] = spec
    return spec

