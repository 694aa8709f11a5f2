"""Progress of long loads (issue 20's "never a traceback" and the nsys/py-spy convention of a
progress line): the callback ``check`` / ``info`` / ``report`` pass to ``load``."""

from __future__ import annotations

import io
from pathlib import Path

from pdtrace.commands import progress as progress_mod
from pdtrace.tracefile.trace import load

SAMPLE = Path(__file__).resolve().parent.parent / "pdtrace/samples/demo_lookahead_misalignment.jsonl"


def test_progress_line_reaches_100_percent(monkeypatch):
    monkeypatch.setattr(progress_mod, "MIN_BYTES", 0)
    out = io.StringIO()
    load(str(SAMPLE), progress=progress_mod.load_progress(str(SAMPLE), stream=out))
    assert out.getvalue().startswith("\rloading demo_lookahead_misalignment.jsonl:")
    assert out.getvalue().endswith("100% (0/0 MB, 0 s)\n")


def test_progress_on_a_damaged_trace_read_leniently(tmp_path, monkeypatch):
    """The lenient re-read (``scan``) reports progress too (it once raised NameError)."""
    monkeypatch.setattr(progress_mod, "MIN_BYTES", 0)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(SAMPLE.read_bytes()[:3000])
    out = io.StringIO()
    tr = load(str(cut), lenient=True, progress=progress_mod.load_progress(str(cut), stream=out))
    assert tr.problems and tr.events and out.getvalue().endswith("100% (0/0 MB, 0 s)\n")


def test_no_progress_line_off_a_terminal_or_for_a_small_file():
    assert progress_mod.load_progress(str(SAMPLE)) is None  # small (and stderr is captured)
