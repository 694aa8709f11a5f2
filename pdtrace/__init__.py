"""pdtrace: trace and debug vLLM prefill/decode disaggregation (NIXL) with speculative decoding."""

import os as _os

__version__ = "0.1.0"

# Installed, the hooks and viewers are the subpackages pdtrace.hooks and pdtrace.viewers (pyproject
# maps them from the checkout's top-level hooks/ and viewers/). Run from a checkout's root
# (`python -m pdtrace` there, which finds this directory before any installed copy), that mapping
# is absent: look for those subpackages in the checkout's root too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "hooks")) and \
        _os.path.isfile(_os.path.join(_root, "hooks", "__init__.py")):
    __path__.append(_root)
del _root

from . import _moved  # noqa: E402 - the names the restructure moved, importable for a release

_moved.install()
