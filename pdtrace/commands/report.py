"""`pdtrace report TRACE -o report.html`: the self-contained Plotly HTML report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import PdtraceError
from ..tracefile.damage import warn_problems


def load_with_findings(trace: Path, lenient: bool) -> tuple[Any, list, str]:
    """Load the trace and run the detectors. Returns (trace, findings, note); the note says
    why there are no findings when the detectors could not run."""
    from .progress import load_progress
    from ..tracefile.trace import load

    tr = load(str(trace), lenient=lenient, progress=load_progress(str(trace)))
    warn_problems(tr)
    try:
        from ..detectors import run_all
    except ImportError as exc:
        return tr, [], f"detectors unavailable ({exc}); findings not computed"
    try:
        from ..detectors.checking import after_gap

        findings = after_gap(list(run_all(tr.events, header=tr.header)), tr)  # (past a damaged .zst frame)
    except Exception as exc:  # a detector bug must not cost the user the report
        return tr, [], f"detectors failed: {type(exc).__name__}: {exc}; findings not computed"
    return tr, findings, ""


WHOLE_UP_TO = 1_000_000  # events: a bigger trace (or a cut one this size on disk) is read in two passes


def _too_big(trace: Path) -> bool:
    from ..tracefile.ends import read_ends

    try:
        _h, foot, size = read_ends(str(trace))
    except Exception:  # noqa: BLE001 - the load says what is wrong with the file
        return False
    if foot and isinstance(foot.get("events"), int):
        return foot["events"] > WHOLE_UP_TO
    return size > WHOLE_UP_TO * 300  # no footer: ~300 bytes an event


def read_reduced(trace: Path, lenient: bool) -> tuple[Any, list, str]:
    """A trace too big to hold, in two passes (``viewers.html.reduce``): the findings of the
    streamed check and the events the page can show, with the trace's counts."""
    from .progress import load_progress
    from ..viewers.html import reduce

    tr, findings, _cov = reduce.read(str(trace), lenient=lenient,
                                     progress=load_progress(str(trace), verb="reading (pass 1 of 2)"))
    warn_problems(tr)
    return tr, findings, ""


def run(trace: Path, output: Path, lenient: bool = False) -> int:
    from ..viewers.html import report as html_report

    if _too_big(Path(trace)):
        tr, findings, note = read_reduced(Path(trace), lenient)
    else:
        tr, findings, note = load_with_findings(Path(trace), lenient)
    try:
        stats = html_report.write(tr, output, findings, findings_note=note)
    except OSError as exc:
        raise PdtraceError(f"cannot write {output}: {exc.strerror or exc}") from None
    agg = (f", timeline: {stats['drawn']:,} events drawn, {stats['aggregated']:,} in time bins"
           if stats.get("aggregated") else "")
    if getattr(tr, "totals", None) is not None:
        agg += (f"; {tr.totals.n:,} events read in two passes, {len(tr.events):,} of them held to draw the page "
                f"({stats['events_embedded']:,} in its event table)")
    print(f"wrote {output} ({stats['bytes'] / 1e6:.2f} MB, {len(findings)} finding(s), "
          f"{stats['figures']} figure(s){agg})", file=sys.stderr)
    if note:
        print(f"pdtrace: warning: {note}", file=sys.stderr)
    return 0
