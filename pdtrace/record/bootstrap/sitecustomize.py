"""pdtrace bootstrap, imported by Python's `site` in every process `pdtrace record` starts.

`pdtrace record` puts this directory first on PYTHONPATH and sets PDTRACE_SESSION_DIR, so
every Python process of the recorded command (API server, engine core, multiprocessing
spawn children, TP workers, subprocesses) starts recording at interpreter start-up. Any
sitecustomize that was already on the path is then run as well (chained), so the traced
program sees its own start-up code unchanged. Nothing here may raise.
"""

from __future__ import annotations

import os
import sys


def _pdtrace_start() -> None:
    if not os.environ.get("PDTRACE_SESSION_DIR"):
        return
    try:
        from pdtrace.record.bootstrap import runtime

        runtime.start_from_env()
    except Exception as exc:  # pdtrace missing in this interpreter, or broken: never stop the program
        sys.stderr.write(f"pdtrace: not recording pid {os.getpid()}: {type(exc).__name__}: {exc}\n")


def chain_next_sitecustomize(here: str | None = None, after_only: bool = False) -> None:
    """Run the sitecustomize that ``site`` would have run had ``here`` not been on the path:
    the first found in the other entries of ``sys.path`` (``after_only``: the entries after
    ``here``, for another sitecustomize that pdtrace's chained to, scripts/live_site)."""
    import importlib.machinery
    import importlib.util

    here = here or os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    if after_only:
        rest = sys.path[paths.index(here) + 1:] if here in paths else []
    else:
        rest = [p for p, a in zip(sys.path, paths) if a != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # the same as Python's own behaviour for a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")


if __name__ == "sitecustomize":  # (not when imported for chain_next_sitecustomize)
    _pdtrace_start()
    chain_next_sitecustomize()
