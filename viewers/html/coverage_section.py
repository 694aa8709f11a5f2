"""The report's coverage table: per bug class, could this trace decide it (the same
``pdtrace.detectors.coverage`` verdicts `check` prints: checked / does not apply / not
checked: why). A class that was not checked is never shown as clean."""

from __future__ import annotations

import html
from typing import Any, Callable

from pdtrace.detectors.coverage import CHECKED, NOT_CHECKED, coverage, incomplete_reason


def coverage_html(events: list[dict], header: dict | None, footer: dict | None,
                  findings_cell: Callable[[str, Any], str] | None = None, problems: Any = 0,
                  cov: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """(the <table>, the kinds not checked). ``findings_cell(kind, coverage)``, when given,
    fills a third column (the report's summary puts the findings per class there). A trace
    with damaged lines or no footer checks no class (``coverage(incomplete=...)``), as `check`;
    ``problems``: the load's problem list (a damaged .zst's gap too), or a count of damaged lines.
    ``cov``: the verdicts already computed (a trace read in two passes, ``reduce``)."""
    try:
        if cov is None:
            cov = coverage(events, header, footer, incomplete=incomplete_reason(footer, problems))
    except Exception as exc:  # noqa: BLE001 - a damaged trace must still render; say so
        return (f'<p class="warn">coverage could not be computed ({html.escape(type(exc).__name__)}): '
                "no bug class is shown as checked</p>", ["(all)"])
    rows = []
    for kind, c in cov.items():
        cls = "ok" if c.status == CHECKED else ("warn" if c.status == NOT_CHECKED else "note")
        extra = f"<td>{findings_cell(kind, c)}</td>" if findings_cell else ""
        rows.append(f'<tr class="{cls}"><td>{html.escape(kind)}</td><td>{html.escape(c.line())}</td>{extra}</tr>')
    head = "<th>bug class</th><th>verdict on this trace</th>" + ("<th>findings</th>" if findings_cell else "")
    table = (f'<h3>Coverage</h3><table class="coverage"><tr>{head}</tr>' + "".join(rows) + "</table>")
    return table, [k for k, c in cov.items() if c.status == NOT_CHECKED]


def no_findings_line(not_checked: list[str], extra: Any = None) -> str:
    if not not_checked:
        return '<p class="ok">No findings; every bug class that applies was checked.</p>'
    return (f'<p class="warn">No findings in the classes checked; {len(not_checked)} class(es) not checked: '
            + html.escape(", ".join(not_checked)) + " (see Coverage).</p>")
