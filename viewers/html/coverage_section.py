"""The report's coverage table: per bug class, could this trace decide it (the same
``pdtrace.detectors.coverage`` verdicts `check` prints: checked / does not apply / not
checked: why). A class that was not checked is never shown as clean."""

from __future__ import annotations

import html
from typing import Any

from pdtrace.detectors.coverage import CHECKED, NOT_CHECKED, coverage


def coverage_html(events: list[dict], header: dict | None, footer: dict | None) -> tuple[str, list[str]]:
    """(the <table> for the findings section, the kinds not checked)."""
    try:
        cov = coverage(events, header, footer)
    except Exception as exc:  # noqa: BLE001 - a damaged trace must still render; say so
        return (f'<p class="warn">coverage could not be computed ({html.escape(type(exc).__name__)}): '
                "no bug class is shown as checked</p>", ["(all)"])
    rows = []
    for kind, c in cov.items():
        cls = "ok" if c.status == CHECKED else ("warn" if c.status == NOT_CHECKED else "note")
        rows.append(f'<tr class="{cls}"><td>{html.escape(kind)}</td><td>{html.escape(c.line())}</td></tr>')
    table = ('<h3>Coverage</h3><table class="coverage"><tr><th>bug class</th><th>verdict on this trace</th></tr>'
             + "".join(rows) + "</table>")
    return table, [k for k, c in cov.items() if c.status == NOT_CHECKED]


def no_findings_line(not_checked: list[str], extra: Any = None) -> str:
    if not not_checked:
        return '<p class="ok">No findings; every bug class that applies was checked.</p>'
    return (f'<p class="warn">No findings in the classes checked; {len(not_checked)} class(es) not checked: '
            + html.escape(", ".join(not_checked)) + " (see Coverage).</p>")
