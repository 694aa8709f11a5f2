"""Start-up code of the live CPU test servers (scripts/live_cpu_pd.py puts this directory on
their PYTHONPATH; pdtrace's own bootstrap, first on the path, chains to it). Test harness only:
nothing in pdtrace imports it.

NIXL's Python API (`nixl_agent.__init__`, nixl 1.5.1 `_api.py`) hard-codes
`agent_config.pthrDelay = 0`. The UCX backend's shared progress thread uses that delay,
rounded up to whole milliseconds, as its poll() timeout (`nixlUcxSharedThread::run`), so with 0
it never sleeps: every idle vLLM worker with a NIXL agent burns one core (measured here: an
idle agent alone 49% of this 2-core VM; an idle P or D worker 93-98% of its core). On a
2-core host running three servers, a server that starts after P and D are ready is pinned to a
core where such a thread spins, and this VM's scheduler then gives it almost nothing of that
core (D2's worker: 0.3%; a plain Python loop pinned beside a spinning one: 2-8%):
the 1P2D test's D2 stalled for minutes ("servers not ready after 600s: ['D2']").

When `nixl*._bindings` is imported, `nixlAgent` is wrapped so that a config asking for 0 gets
PDTRACE_LIVE_NIXL_PTHR_DELAY_US instead (default 1000: poll() wakes on the workers' event fds
as before, and otherwise every 1 ms; idle cost measured 2%). Transfers, notifications and the
connector's own logic are untouched. PDTRACE_LIVE_NIXL_PTHR_DELAY_US=0 turns this off.
"""

import os
import sys


def _delay_us() -> int:
    try:
        return max(0, int(os.environ.get("PDTRACE_LIVE_NIXL_PTHR_DELAY_US", "1000")))
    except ValueError:
        return 1000


def _patch_bindings(mod, delay_us: int) -> None:
    agent_cls = getattr(mod, "nixlAgent", None)
    if agent_cls is None or getattr(agent_cls, "_pdtrace_live_wrapped", False):
        return

    def nixlAgent(name, config, *args, **kwargs):  # noqa: N802 (the binding's own name)
        try:
            if getattr(config, "pthrDelay", None) == 0:
                config.pthrDelay = delay_us
                sys.stderr.write(f"live_site: NIXL agent {name}: progress-thread pthrDelay 0 -> {delay_us} us "
                                 f"(pid {os.getpid()})\n")
        except Exception:
            pass
        return agent_cls(name, config, *args, **kwargs)

    nixlAgent._pdtrace_live_wrapped = True
    mod.nixlAgent = nixlAgent


def _is_bindings(name: str) -> bool:
    """`nixl._bindings`, `nixl_cu12._bindings`, ...: the module that holds nixlAgent."""
    top, _, rest = name.partition(".")
    return rest == "_bindings" and top.startswith("nixl")


class _NixlBindingsFinder:
    """A meta-path finder that lets the real finders load `nixl*._bindings`, then wraps it."""

    def __init__(self, delay_us: int):
        self.delay_us = delay_us

    def find_spec(self, fullname, path=None, target=None):
        if not _is_bindings(fullname):
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, delay_us = spec.loader, self.delay_us

        class _Loader:
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch_bindings(module, delay_us)

        spec.loader = _Loader()
        return spec


def _install() -> None:
    delay_us = _delay_us()
    if delay_us <= 0:
        return
    for name, mod in list(sys.modules.items()):  # already imported (not at start-up, but cheap)
        if _is_bindings(name) and mod is not None:
            _patch_bindings(mod, delay_us)
    sys.meta_path.insert(0, _NixlBindingsFinder(delay_us))


try:
    _install()
except Exception as exc:  # never stop the server
    sys.stderr.write(f"live_site: NIXL progress-thread delay not set: {type(exc).__name__}: {exc}\n")
if os.environ.get("PDTRACE_LABELLED_FAULT"):  # a live test's labelled fault (labelled_faults.py beside this file)
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import labelled_faults

        labelled_faults.install()
    except Exception as exc:
        sys.stderr.write(f"live_site: labelled faults not armed: {type(exc).__name__}: {exc}\n")
    finally:
        sys.path.pop(0)
try:  # the sitecustomize after this one on the path, as pdtrace's bootstrap chains to this one
    from pdtrace.record.bootstrap.sitecustomize import chain_next_sitecustomize

    chain_next_sitecustomize(os.path.dirname(os.path.abspath(__file__)), after_only=True)
except ImportError:  # pdtrace not installed in this interpreter: nothing after this one runs
    pass
