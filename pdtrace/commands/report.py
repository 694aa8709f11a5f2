"""`pdtrace report TRACE -o report.html`: the self-contained Plotly HTML report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import PdtraceError, warn_problems


def load_with_findings(trace: Path, lenient: bool) -> tuple[Any, list, str]:
    """Load the trace and run the detectors. Returns (trace, findings, note); the note says
    why there are no findings when the detectors could not run."""
    from ..progress import load_progress
    from ..trace import load

    tr = load(str(trace), lenient=lenient, progress=load_progress(str(trace)))
    warn_problems(tr)
    try:
        from ..detectors import run_all
    except ImportError as exc:
        return tr, [], f"detectors unavailable ({exc}); findings not computed"
    try:
        findings = list(run_all(tr.events, header=tr.header))
    except Exception as exc:  # a detector bug must not cost the user the report
        return tr, [], f"detectors failed: {type(exc).__name__}: {exc}; findings not computed"
    return tr, findings, ""


def run(trace: Path, output: Path, lenient: bool = False) -> int:
    from ..viewers.html import report as html_report

    tr, findings, note = load_with_findings(Path(trace), lenient)
    try:
        stats = html_report.write(tr, output, findings, findings_note=note)
    except OSError as exc:
        raise PdtraceError(f"cannot write {output}: {exc.strerror or exc}") from None
    agg = f", {stats['aggregated']:,} events aggregated" if stats.get("aggregated") else ""
    print(f"wrote {output} ({stats['bytes'] / 1e6:.2f} MB, {len(findings)} finding(s), "
          f"{stats['figures']} figure(s){agg})", file=sys.stderr)
    if note:
        print(f"pdtrace: warning: {note}", file=sys.stderr)
    return 0
