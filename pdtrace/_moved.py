"""The module names the restructure (8d98013: pdtrace/ by layer) moved, kept importable for one
release with a DeprecationWarning (issue 48): a program that writes its own ``mark`` events with
``from pdtrace import recorder`` keeps working, and is told the new name.

``pdtrace.recorder`` *is* ``pdtrace.record.recorder`` (the same module object, not a copy), so
state such as the current recorder is shared. The old ``pdtrace.index`` module is now the
package of that name; its classes answer there through ``pdtrace.index.__getattr__``, warning
the same way. Remove both in pdtrace 0.3.0.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

REMOVED_IN = "0.3.0"

MOVED: dict[str, str] = {
    "pdtrace.recorder": "pdtrace.record.recorder",
    "pdtrace.frames": "pdtrace.record.frames",
    "pdtrace.materialize": "pdtrace.record.materialize",
    "pdtrace.online": "pdtrace.record.online",
    "pdtrace.redact": "pdtrace.record.redact",
    "pdtrace.ring": "pdtrace.record.ring",
    "pdtrace.shards": "pdtrace.record.shards",
    "pdtrace.bootstrap": "pdtrace.record.bootstrap",
    "pdtrace.trace": "pdtrace.tracefile.trace",
    "pdtrace.compress": "pdtrace.tracefile.compress",
    "pdtrace.ends": "pdtrace.tracefile.ends",
    "pdtrace.eventlist": "pdtrace.tracefile.eventlist",
    "pdtrace.footer": "pdtrace.tracefile.footer",
    "pdtrace.reading": "pdtrace.tracefile.reading",
    "pdtrace.segments": "pdtrace.tracefile.segments",
    "pdtrace.typecheck": "pdtrace.tracefile.typecheck",
    "pdtrace.versions": "pdtrace.tracefile.versions",
    "pdtrace.writer": "pdtrace.tracefile.writer",
    "pdtrace.zsource": "pdtrace.tracefile.zsource",
    "pdtrace.join": "pdtrace.merge",
    "pdtrace.whatif": "pdtrace.detectors.whatif",
    "pdtrace.progress": "pdtrace.commands.progress",
    "pdtrace.index_blocks": "pdtrace.index.blocks",
    "pdtrace.index_search": "pdtrace.index.search",
    "pdtrace.index_shards": "pdtrace.index.shards",
}
# the old module pdtrace.index (now a package): its public names, now in pdtrace.index.trace_index
OLD_INDEX_NAMES = ("TraceIndex", "ScanProgress", "UNKNOWN_KIND", "NO_STEP", "NO_REQ")


def warn(old: str, new: str) -> None:
    """One DeprecationWarning, attributed to the first frame outside the import machinery (so
    Python's default filters show it for a script or ``python -c``)."""
    skip = (__file__, _INDEX_INIT, importlib.__file__)
    level, f = 2, sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith("<frozen importlib"):  # warnings.warn skips these itself: not counted
            f = f.f_back
        elif name in skip:
            f, level = f.f_back, level + 1
        else:
            break
    warnings.warn(f"{old} moved to {new}; the old name goes in pdtrace {REMOVED_IN}", DeprecationWarning,
                  stacklevel=level)


_INDEX_INIT = __file__.rsplit("_moved.py", 1)[0] + "index/__init__.py"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name as its new module (the same object), warning once: a module is
    imported once per process, after that ``sys.modules`` answers."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> Any:
        warn(spec.name, MOVED[spec.name])
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # importlib sets the alias's spec on the module: put it back
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # already executed under its new name


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
