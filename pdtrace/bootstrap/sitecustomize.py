"""pdtrace bootstrap, imported by Python's `site` in every process `pdtrace record` starts.

`pdtrace record` puts this directory first on PYTHONPATH and sets PDTRACE_SESSION_DIR, so
every Python process of the recorded command (API server, engine core, multiprocessing
spawn children, TP workers, subprocesses) starts recording at interpreter start-up. Any
sitecustomize that was already on the path is then run as well (chained), so the traced
program sees its own start-up code unchanged. Nothing here may raise.
"""

import os
import sys


def _pdtrace_start() -> None:
    if not os.environ.get("PDTRACE_SESSION_DIR"):
        return
    try:
        from pdtrace.bootstrap import runtime

        runtime.start_from_env()
    except Exception as exc:  # pdtrace missing in this interpreter, or broken: never stop the program
        sys.stderr.write(f"pdtrace: not recording pid {os.getpid()}: {type(exc).__name__}: {exc}\n")


def _chain_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # the same as Python's own behaviour for a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")


_pdtrace_start()
_chain_next_sitecustomize()
