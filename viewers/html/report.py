"""The self-contained Plotly HTML report (``pdtrace report``): the assembler.

``render(trace, findings, ...)`` returns one HTML document that works offline: plotly.js
(read from the installed ``plotly`` package, never a CDN), the figure data, the findings'
time ranges and the event table are stored gzip-compressed + base64 inside the page and
unpacked by the browser with ``DecompressionStream`` (Chromium 80+, Firefox 113+, Safari
16.4+); ``report.js`` (inlined) draws the figures, the paged event table and the finding
navigation. The page stays under ``max_bytes`` for any trace size: events far from
findings are aggregated into time bins, the event table keeps the cited and nearby events
first, and the page says how many of each were left out.

Sections, each from its own module: the summary (``summary``, ``coverage_section``), the
findings table, the timeline (``fig_timeline``), block maps (``fig_blockmap``), accepted
counts (``fig_accepted``), connector metadata (``fig_metadata``), drafter windows
(``fig_windows``) and the event table (``events_table``). ``common`` holds the colours,
the helpers and the ``Model`` they all draw from.

No vLLM / torch import here: the report reads only trace events.
"""

from __future__ import annotations

import base64
import gzip
import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import orjson

from pdtrace.detectors import by_severity

from . import (events_table, fig_accepted, fig_blockmap, fig_crossing, fig_kvload, fig_metadata, fig_timeline,
               fig_windows, summary)
from .common import GREEN, ORANGE, RED, FindingView, Model, esc  # noqa: F401 - re-exported for tests / tools

MAX_BYTES = 5_000_000  # the whole page
DEFAULT_POINT_BUDGET = 30_000  # individually drawn events in the timeline
DEFAULT_EVENT_CAP = events_table.DEFAULT_EVENT_CAP  # rows of the event table embedded
_HERE = Path(__file__).parent
_TEMPLATE = _HERE / "template.html"
_SCRIPT = _HERE / "report.js"
_RED, _GREEN, _ORANGE = RED, GREEN, ORANGE  # the names earlier versions exported


# ------------------------------------------------------------------------------ packing
def _plotly_js() -> bytes:
    spec = importlib.util.find_spec("plotly")
    if spec and spec.origin:
        p = Path(spec.origin).parent / "package_data" / "plotly.min.js"
        if p.exists():
            return p.read_bytes()
    from plotly.offline import get_plotlyjs  # pragma: no cover - layout of other plotly versions

    return get_plotlyjs().encode()


_PLOTLY_B64: dict[str, str] = {}


def _packed_plotly() -> str:
    if "js" not in _PLOTLY_B64:
        _PLOTLY_B64["js"] = base64.b64encode(gzip.compress(_plotly_js(), 9, mtime=0)).decode()
    return _PLOTLY_B64["js"]


def _pack(obj: Any) -> str:
    return base64.b64encode(gzip.compress(orjson.dumps(obj), 6, mtime=0)).decode()


def unpack_data(page: str) -> dict[str, Any]:
    """The data embedded in a report page (for tests and tools): ``figs`` (id -> plotly
    figure), ``timefigs`` (ids of the figures whose x axis is time), ``findings`` (per
    finding: the time range ``x`` a click zooms to, the ``span`` of its cited events, shaded,
    and the cited ``ids``) and ``events`` (the event table)."""
    start = page.index('<script id="pd-data" type="application/octet-stream">') + len(
        '<script id="pd-data" type="application/octet-stream">')
    end = page.index("</script>", start)
    return orjson.loads(gzip.decompress(base64.b64decode(page[start:end].strip())))


# ------------------------------------------------------------------------------ page
def render(trace: Any, findings: Iterable[Any] | None = None, *, findings_note: str = "",
           max_bytes: int = MAX_BYTES, point_budget: int = DEFAULT_POINT_BUDGET,
           event_cap: int = DEFAULT_EVENT_CAP) -> tuple[str, dict[str, Any]]:
    """Render the report page for a loaded ``pdtrace.tracefile.trace.Trace``. Returns (html, stats).
    Over ``max_bytes`` the point budget and the event-table cap shrink until the page fits
    (or both reach their floor)."""
    fv = [FindingView.of(f) for f in by_severity(findings or [])]  # numbered as check numbers them
    budget, cap = point_budget, event_cap
    js = _packed_plotly()
    while True:
        page, stats = _render_once(trace, fv, findings_note, budget, cap, js)
        stats["bytes"] = len(page.encode())
        stats["point_budget"] = budget
        stats["event_cap"] = cap
        if stats["bytes"] <= max_bytes or (budget <= 200 and cap <= 1000):
            return page, stats
        shrink = max_bytes / stats["bytes"] * 0.8
        budget = max(200, int(budget * shrink))
        cap = max(1000, int(cap * shrink))


def _figure_section(sec_id: str, heading: str, intro: str, note: str, empty: str, figs: list[Any],
                    fig_div: Callable[[str, Any], str]) -> str:
    """<section> with an intro (HTML, colour words from ``common.swatch``) plus the decimation
    note, if any, the figures, or a line saying there is nothing of this kind in the trace."""
    body = ['<p class="note">' + intro + (f" <b>{esc(note)}.</b>" if note else "") + "</p>"]
    if not figs:
        body.append(f'<p class="ok">{empty}</p>')
    for i, fig in enumerate(figs):
        body.append(fig_div(f"fig-{sec_id}-{i}", fig))
    return f'<section id="{sec_id}"><h2>{heading}</h2>' + "".join(body) + "</section>"


LOOKAHEAD, METADATA = "lookahead-block-misalignment", "connector-metadata-cleared-before-drafter"


def _not_applicable(trace: Any) -> dict[str, str]:
    """The bug classes that do not apply to the recorded configuration, with vLLM's reason (the
    coverage `pdtrace check` gives): their sections are one line, not an empty chart."""
    cov = getattr(trace, "coverage", None)
    if cov is None:
        try:
            from pdtrace.detectors.coverage import coverage

            cov = coverage(trace.events, trace.header, trace.footer)
        except Exception:  # noqa: BLE001 - without it every section is drawn as before
            return {}
    return {k: c.reason for k, c in cov.items() if c.status == "not-applicable"}


def _render_once(trace: Any, fv: list[FindingView], findings_note: str, budget: int, cap: int,
                 js: str) -> tuple[str, dict]:
    events = trace.events
    totals = getattr(trace, "totals", None)  # a trace read in two passes (reduce): events are those kept
    m = Model(events, fv, totals=totals)
    sections: list[str] = []
    figs: dict[str, dict] = {}
    timefigs: list[str] = []

    def fig_div(fid: str, fig: dict, time_axis: bool = False) -> str:
        figs[fid] = fig
        if time_axis:
            timefigs.append(fid)
        h = int(fig["layout"].get("height", 400))
        return f'<div id="{fid}" class="pdfig" style="min-height:{h}px"></div>'

    def time_div(fid: str, fig: dict) -> str:
        return fig_div(fid, fig, True)

    tl, st = fig_timeline.timeline(m, budget, bins=max(50, min(400, budget // 40)))
    sections.append('<section id="timeline"><h2>Timeline</h2><p class="note">'
                    + fig_timeline.caption(tl, st, st.get("opened_on")) + "</p>" + time_div("fig-timeline", tl)
                    + "</section>")

    n_a = _not_applicable(trace)  # class -> why it does not apply: its section is that one line
    maps, note = fig_blockmap.block_maps(m, limit=12)
    body = ([f'<p class="note">{fig_blockmap.caption([fig for _r, _t, fig in maps], note)}</p>'] if maps
            or LOOKAHEAD not in n_a else
            [f'<p class="ok">No KV transfers in this trace: {esc(LOOKAHEAD)} does not apply ({esc(n_a[LOOKAHEAD])}).</p>'])
    if fig_crossing.drafter_requests(m.findings):  # (their blocks per KV cache group are drawn there)
        body.append('<p class="note">The requests whose drafter group never got its KV (kv-never-crossed) are drawn '
                    'per KV cache group under <a href="#crossing">Prompt tokens</a>.</p>')
    reqfigs: dict[str, list[str]] = {}  # block-map figure -> the requests it draws (D's and P's id)
    for i, (req, _title, fig) in enumerate(maps):
        reqfigs[f"fig-blockmap-{i}"] = sorted({req, m.d2p.get(req, req)})
        # both sides' ids: a finding names P's request, the block map is D's (a new user looked for one in the other)
        p_req = m.d2p.get(req)
        head = f"D {esc(req)} ← P {esc(p_req)}" if p_req and p_req != req else esc(req)
        body.append(f'<h3 id="req-{esc(req)}">{head}</h3>' + fig_div(f"fig-blockmap-{i}", fig))
    sections.append('<section id="blockmaps"><h2>Block mapping per affected request</h2>' + "".join(body) + "</section>")

    loads, note = fig_kvload.load_maps(m, limit=12)
    if loads:
        body = [f'<p class="note">{fig_kvload.caption([fig for _r, _t, fig in loads], note)}</p>']
        for i, (req, _title, fig) in enumerate(loads):
            reqfigs[f"fig-kvload-{i}"] = sorted({req, m.d2p.get(req, req)})
            body.append(f'<h3 id="kvload-{esc(req)}">{esc(req)}</h3>' + fig_div(f"fig-kvload-{i}", fig))
        sections.append('<section id="kvload"><h2>KV load failures: blocks and recovery per request</h2>'
                        + "".join(body) + "</section>")

    crossing = fig_crossing.section(trace, fig_div, m.findings)
    if crossing:
        sections.append(crossing)

    acc, note = fig_accepted.accepted(m, budget=max(500, budget // 4), limit=4)
    sections.append(_figure_section("accepted", "Accepted-token counts", fig_accepted.caption([fig for _ln, fig in acc]), note,
                                    "No accepted-count reads in this trace.", [fig for _ln, fig in acc], time_div))

    if METADATA in n_a and not any(f.kind == METADATA for f in fv):
        sections.append(f'<section id="metadata"><h2>Connector metadata phases</h2><p class="ok">{esc(METADATA)} '
                        f'does not apply ({esc(n_a[METADATA])}): nothing drawn.</p></section>')
    else:
        meta, note = fig_metadata.metadata(m, max_steps=max(20, budget // 600), limit=4)
        sections.append(_figure_section("metadata", "Connector metadata phases",
                                        fig_metadata.caption([fig for _ln, fig in meta]), note,
                                        "No connector-metadata events in this trace.", [fig for _ln, fig in meta],
                                        time_div))

    win, note = fig_windows.windows(m, limit=40)
    if win is not None or note:
        sections.append('<section id="windows"><h2>Drafter KV write windows</h2>'
                        + f'<p class="note">{fig_windows.caption(win, note)}</p>'
                        + (fig_div("fig-windows", win) if win is not None else "") + "</section>")

    listed = fv[:summary.MAX_FINDING_ROWS]
    chosen, ev_stats = events_table.select(m, cap, len(listed))
    embedded = {eid for eid, _e in chosen}
    sections.append(events_table.section_html(ev_stats))

    ranges = [m.finding_range(f) for f in listed]
    top = (summary.overview_html(m, trace.header, trace.footer, events, findings_note,
                                 problems=list(trace.problems), cov=getattr(trace, "coverage", None))
           + summary.findings_html(m, ranges, embedded.__contains__)
           + summary.trace_html(trace.header, trace.footer, trace.problems, events, totals=totals))
    title = f"pdtrace report: {os.path.basename(str(getattr(trace, 'path', '') or 'trace'))}"
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (
        ("overview", "Summary"), ("findings", "Findings"), ("timeline", "Timeline"), ("blockmaps", "Block maps"),
        *((("kvload", "KV load failures"),) if loads else ()), *((("crossing", "Prompt tokens"),) if crossing else ()),
        ("accepted", "Accepted counts"), ("metadata", "Connector metadata"), ("events", "Events"),
        ("summary", "Trace")))
    data = {"figs": figs, "timefigs": timefigs, "reqfigs": reqfigs,
            "findings": [{"x": list(r) if r else None, "span": list(m.finding_span(f) or []) or None,
                          "ids": f.event_ids, "kind": f.kind, "sev": f.severity,
                          "reqs": sorted({str(r) for r in (f.req, (f.data or {}).get("p_req"), (f.data or {}).get("d_req"))
                                          if r}),
                          "req": f.req, "step": f.step, "inst": f.inst, "title": f.title}
                         for f, r in zip(listed, ranges)],
            "events": events_table.table_data(m, chosen, ev_stats)}
    parts = {"TITLE": esc(title), "NAV": nav, "SUMMARY": top, "SECTIONS": "\n".join(sections),
             "PLOTLY": js, "DATA": _pack(data), "SCRIPT": _SCRIPT.read_text(encoding="utf-8")}
    tpl = _TEMPLATE.read_text(encoding="utf-8")
    page = re.sub(r"\{\{([A-Z]+)\}\}", lambda mo: parts[mo.group(1)], tpl)  # one pass: data never re-expanded
    stats = dict(st)
    stats.pop("opened_on", None)
    stats["figures"] = len(figs)
    stats["figure_ids"] = sorted(figs)
    stats["time_figures"] = list(timefigs)
    stats["events_embedded"] = ev_stats["embedded"]
    stats["events_trimmed"] = ev_stats["trimmed"]
    return page, stats


def write(trace: Any, path: str | os.PathLike, findings: Iterable[Any] | None = None, **kw: Any) -> dict[str, Any]:
    page, stats = render(trace, findings, **kw)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, path)
    return stats
