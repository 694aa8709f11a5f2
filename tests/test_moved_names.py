"""The module names the restructure moved stay importable for a release, with a DeprecationWarning
(issue 48): each in a fresh interpreter, as a user's script imports it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdtrace import _moved

PROBE = r"""
import importlib, json, sys, warnings
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    mod = importlib.import_module(old)
    again = importlib.import_module(old)
real = importlib.import_module(new)
print(json.dumps({"same": mod is real and again is real, "spec": real.__spec__.name,
                  "warnings": [(x.category.__name__, str(x.message), x.filename) for x in w]}))
"""


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_module_name_is_the_new_module_and_warns_once(old):
    new = _moved.MOVED[old]
    out = subprocess.run([sys.executable, "-c", PROBE, old, new], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"] and got["spec"] == new  # the same module object; its own spec kept
    (w,) = got["warnings"]  # once, however often it is imported
    assert w[0] == "DeprecationWarning" and old in w[1] and new in w[1] and _moved.REMOVED_IN in w[1]
    assert w[2] == "<string>"  # attributed to the importing code, so Python's default filter shows it


def test_from_pdtrace_import_recorder_shows_the_warning_by_default():
    """The README's own example of a program writing its mark events, as it was written before the
    move: works, and the default warning filters print the warning (it names the caller)."""
    out = subprocess.run([sys.executable, "-c", "from pdtrace import recorder; print(recorder.Recorder.__name__)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "Recorder", out.stderr
    assert "DeprecationWarning: pdtrace.recorder moved to pdtrace.record.recorder" in out.stderr


def test_the_old_index_module_names_answer_from_the_package():
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", "from pdtrace.index import TraceIndex"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pdtrace.index.TraceIndex moved to pdtrace.index.trace_index" in out.stderr
    out = subprocess.run([sys.executable, "-c", "from pdtrace.index import TraceIndex as a\n"
                          "from pdtrace.index.trace_index import TraceIndex as b\nassert a is b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with pytest.raises(AttributeError):
        import pdtrace.index

        pdtrace.index.NoSuchName  # noqa: B018
