"""pdtrace.hooks: monkeypatch hooks on vLLM, one module per vLLM subsystem.

Each subsystem module (``scheduler``, ``nixl``, ``connector_metadata``, ``accepted_counts``,
``input_batch``, ``worker``, ``runner``; for model runner V2 ``spec_v2``, ``states_v2``)
declares ``HookSpec``s with ``register(...)`` at import. A spec names the
vLLM target (module, ``Class.attr``), the parameter names it expects, and a ``wrap``
factory (original function -> patched function).

- ``install_all()`` patches every target whose module is already imported, and arms a
  post-import hook for the others, so nothing imports vLLM in a process that never does.
- A target that is missing, or whose signature no longer starts with the expected
  parameters, is skipped with the reason (``pdtrace doctor`` shows it); vLLM runs on.
- Wrappers record around the original call: the original's exceptions pass through
  untouched, while an exception in pdtrace's own recording code is swallowed and counted
  (``Recorder.hook_error``), never raised into vLLM.

The package is three modules: ``registry`` (``HookSpec``, ``register``), ``wrappers`` (the
recording wrappers) and ``install`` (resolving, checking, patching); their public names are
importable from ``pdtrace.hooks`` itself, as the subsystem modules and ``pdtrace doctor`` use
them.
"""

from .registry import REGISTRY, SUBSYSTEMS, HookSpec, _armed, register  # noqa: F401
from .wrappers import after, around, before, patch_after  # noqa: F401
from .install import (  # noqa: F401
    _apply, _PostImportFinder, _report_status, check, check_form, install_all, install_now, load_subsystems, status,
    uninstall_all,
)
