"""The event table: the trace's events embedded (compactly, in the page's packed data) for a
paged, filterable table drawn by report.js. Every event a finding cites is always embedded,
so every cited id the page links to (``#ev-<id>``) has its row. Past ``cap`` events the
table keeps, in this order, the cited events, the events near a finding (the requests and
steps findings name, and the events around a cited one), then the earliest events, and the
page says how many were left out."""

from __future__ import annotations

from typing import Any

from .common import Model, esc, lane, rest_fields, short

DEFAULT_EVENT_CAP = 25_000
FIELDS_LIMIT = 240  # characters of the other fields shown per row


def event_id(e: dict[str, Any], index: int) -> int:
    return e.get("id", index)


def select(m: Model, cap: int, listed: int | None = None) -> tuple[list[tuple[int, dict]], dict[str, Any]]:
    """([(id, event)] in id order, stats: total / embedded / cited / trimmed). The events
    cited by the first ``listed`` findings (the ones the page lists) are always embedded."""
    events = m.events
    total = m.n_events  # the trace's (events: those kept for the page, when it was read in two passes)
    cited = {i for f in m.findings[:listed] for i in f.event_ids}
    if len(events) <= cap:
        chosen = [(event_id(e, i), e) for i, e in enumerate(events)]
    else:
        keep: set[int] = set()
        near: list[int] = []
        for i, e in enumerate(events):
            eid = event_id(e, i)
            if eid in cited:
                keep.add(i)
            elif m.near_finding(e):
                near.append(i)
        room = max(cap - len(keep), 0)
        keep.update(near[:room])
        i = 0
        while len(keep) < cap and i < len(events):
            keep.add(i)
            i += 1
        chosen = [(event_id(events[i], i), events[i]) for i in sorted(keep)]
    stats = {"total": total, "embedded": len(chosen), "cited": len(cited), "trimmed": total - len(chosen)}
    return chosen, stats


def table_data(m: Model, chosen: list[tuple[int, dict]], stats: dict[str, Any]) -> dict[str, Any]:
    """Columnar-ish rows for the page: [id, t_ms, lane index, step, req, kind index, fields]."""
    lanes: dict[str, int] = {}
    kinds: dict[str, int] = {}
    rows = []
    for eid, e in chosen:
        ln = lanes.setdefault(lane(e) + f" pid {e.get('pid')}", len(lanes))
        kd = kinds.setdefault(e["ev"], len(kinds))
        rest = rest_fields(e)
        rows.append([eid, round(m.x(e), 3), ln, e.get("step"), e.get("req"), kd,
                     short(rest, FIELDS_LIMIT) if rest else ""])
    return {"lanes": list(lanes), "kinds": list(kinds), "rows": rows, **stats}


def note(stats: dict[str, Any]) -> str:
    if not stats["trimmed"]:
        return f"All {stats['total']:,} events of the trace are in the table."
    return (f"{stats['embedded']:,} of {stats['total']:,} events are embedded in this page (every one of the "
            f"{stats['cited']:,} events the listed findings cite, then the events near findings: the requests and steps they name "
            f"and the events around a cited one, then the earliest events); the other {stats['trimmed']:,} are left "
            "out to keep the page small. Gaps in the ids are marked in the table; open the trace with "
            "<code>pdtrace view</code> for every event.")


def section_html(stats: dict[str, Any]) -> str:
    return (
        '<section id="events"><h2>Events</h2>'
        f'<p class="note" id="pd-ev-note">{note(stats)} Time is ms since the first event, as on the figures\' x axes. '
        "Search matches kind, request, process and fields; step takes <code>5</code> or <code>3-7</code>.</p>"
        '<div class="evctl">'
        '<label>search <input id="pd-ev-q" type="search" placeholder="text in any column" size="22"></label>'
        '<label>kind <select id="pd-ev-kind"><option value="">all</option></select></label>'
        '<label>process <select id="pd-ev-lane"><option value="">all</option></select></label>'
        '<label>request <input id="pd-ev-req" type="search" list="pd-ev-reqs" size="14"></label>'
        '<datalist id="pd-ev-reqs"></datalist>'
        '<label>step <input id="pd-ev-step" type="search" size="6"></label>'
        '<label>go to event # <input id="pd-ev-id" type="search" size="7"></label>'
        '<button id="pd-ev-clear" type="button">clear filters</button>'
        "</div>"
        '<div id="pd-ev-banner" class="banner" hidden></div>'
        '<div class="pager"><button type="button" data-page="first">«</button>'
        '<button type="button" data-page="prev">‹ prev</button><span id="pd-ev-pageinfo"></span>'
        '<button type="button" data-page="next">next ›</button><button type="button" data-page="last">»</button>'
        '<label>rows <select id="pd-ev-size"><option>50</option><option selected>100</option><option>500</option>'
        "</select></label></div>"
        '<table class="events"><colgroup><col class="c-id"><col class="c-t"><col class="c-lane"><col class="c-step">'
        '<col class="c-req"><col class="c-kind"><col></colgroup><thead><tr><th>id</th><th>time (ms)</th><th>process</th><th>step</th><th>request</th>'
        '<th>kind</th><th>fields</th></tr></thead><tbody id="pd-ev-body"><tr><td colspan="7" class="note">'
        f"{esc('the table needs JavaScript')}</td></tr></tbody></table></section>"
    )
