"""The timeline figure: engine steps per instance as bars, every event as a tick on its
process lane (those far from findings aggregated into time bins past the point budget),
KV transfers P -> D as lines, red crosses on cited events. When there are findings the
x axis opens on their time range (double-click or "whole trace" shows everything)."""

from __future__ import annotations

import collections
import html
import math
from typing import Any

from . import fig_kvload
from .common import (GREEN, LIGHT_GREY, RED, STEP_BAR, STEP_BAR_FINDING, Model, cat, finding_markers, hover,
                     lane, lane_key, layout, legend, short)


def caption(fig: dict[str, Any], stats: dict[str, Any], opened_on: tuple[float, float] | None) -> str:
    """The note over the figure: a phrase per trace drawn, its colour from that trace."""
    agg = []
    if stats["aggregated"]:
        agg.append(f"{stats['drawn']:,} of {stats['events']:,} events are drawn one by one (those near a finding); "
                   f"the other {stats['aggregated']:,} events are aggregated into {stats['bins']:,} time bins per lane")
    else:
        agg.append(f"all {stats['events']:,} events are drawn one by one")
    if stats.get("aggregated_steps"):
        agg.append(f"{stats['aggregated_steps']:,} engine steps far from findings are not drawn as bars")
    if stats.get("kv_not_drawn"):
        agg.append(f"{stats['kv_not_drawn']:,} KV transfers without findings are not drawn")
    opened = ""
    if opened_on is not None:
        opened = (f" The x axis opens on the findings' time range ({opened_on[0]:.3f}–{opened_on[1]:.3f} ms); "
                  "double-click the plot or press <i>whole trace</i> (after selecting a finding) to see all of it.")
    items = legend([fig], [
        ("engine steps", STEP_BAR, "bars: engine steps (hover: tokens per request)"),
        ("engine step a finding names", STEP_BAR_FINDING, "bars: engine steps a finding names"),
        ("KV transfer P→D (request with a finding)", RED, "lines: KV transfers of a request with a finding, from P's "
         "request_finished to D's NIXL read and its completion"),
        ("KV transfer P→D", GREEN, "lines: the other KV transfers"),
        ("aggregated events", LIGHT_GREY, "markers: events aggregated per time bin (size = count, hover for the kinds)"),
        ("finding", RED, "×: events a finding cites"),
    ])
    return ("Lanes are instance / process role / rank; ticks are events, coloured by subsystem (see the legend). "
            f"{items}.{opened} <b>{'; '.join(agg)}.</b>")


def _split(m: Model, budget: int) -> tuple[list[dict], list[dict]]:
    events = m.events
    if m.totals is not None and m.n_events > budget:  # read in two passes: the rest is in the time bins
        events = [e for e in events if m.near_finding(e)]
    elif len(events) <= budget:  # (read in two passes: the first reduce.OPENING events were all kept)
        return [e for e in events if e["ev"] != "sched.step"], []
    detail: list[dict[str, Any]] = []
    rest: list[dict[str, Any]] = []
    for e in events:
        if e["ev"] != "sched.step":
            (detail if m.near_finding(e) else rest).append(e)
    if len(detail) > budget:  # keep the events closest to the cited ones
        keep = set(m.finding_ids)
        rest.extend(e for e in detail[budget:] if e.get("id") not in keep)
        detail = detail[:budget] + [e for e in detail[budget:] if e.get("id") in keep]
    return detail, rest


def _step_bars(m: Model, budget: int, stats: dict[str, Any]) -> list[dict]:
    by_lane: dict[str, list[dict]] = collections.defaultdict(list)
    for e in m.events:
        if e["ev"] == "sched.step":
            by_lane[lane(e)].append(e)
    step_budget = max(200, budget // 4)
    tot = m.totals  # read in two passes: every lane's first steps were kept (reduce.STEPS_KEPT)
    # two traces, each with one colour in the legend: plain steps and steps a finding names
    out = {False: {"base": [], "x": [], "y": [], "hovertext": [], "color": []},
           True: {"base": [], "x": [], "y": [], "hovertext": [], "color": []}}
    for ln, ss in by_lane.items():
        ss.sort(key=lambda e: e[m.tkey])
        n_steps = tot.steps(ln) if tot is not None else len(ss)  # the trace's count
        if n_steps > step_budget:
            keep_idx = [i for i, e in enumerate(ss) if m.near_finding(e)][:step_budget]
            stats["aggregated_steps"] = stats.get("aggregated_steps", 0) + n_steps - len(keep_idx)
        else:
            keep_idx = list(range(len(ss)))
        for i in keep_idx:
            e = ss[i]
            x0 = m.x(e)
            x1 = m.x(ss[i + 1]) if i + 1 < len(ss) else x0 + 0.05
            bad = (e.get("inst"), e.get("step")) in m.finding_steps
            t = out[bad]
            t["base"].append(x0)
            t["x"].append(max(x1 - x0, 1e-3))
            t["y"].append(ln)
            t["color"].append(STEP_BAR_FINDING if bad else STEP_BAR[e.get("step", 0) % 2])
            t["hovertext"].append(hover(e))
    traces = []
    for bad, t in out.items():
        if t["x"]:
            traces.append({"type": "bar", "orientation": "h", "base": t["base"], "x": t["x"], "y": t["y"],
                           "name": "engine step a finding names" if bad else "engine steps",
                           "marker": {"color": t["color"], "line": {"width": 0.5, "color": "#ffffff"}},
                           "hovertext": t["hovertext"], "hoverinfo": "text", "width": 0.5, "opacity": 0.8})
    return traces


def _event_ticks(m: Model, detail: list[dict]) -> list[dict]:
    cats: dict[str, dict[str, Any]] = {}
    for e in detail:
        name, color = cat(e["ev"])
        tr = cats.get(name)
        if tr is None:
            tr = cats[name] = {"type": "scattergl" if len(detail) > 5000 else "scatter", "mode": "markers",
                               "name": name, "x": [], "y": [], "hovertext": [], "hoverinfo": "text",
                               "marker": {"color": color, "size": 7, "symbol": "line-ns-open", "line": {"width": 2}}}
        tr["x"].append(m.x(e))
        tr["y"].append(lane(e))
        tr["hovertext"].append(hover(e))
    return list(cats.values())


def _aggregated(m: Model, rest: list[dict], bins: int, stats: dict[str, Any],
                fine: Any = None) -> list[dict]:
    """Per lane, per time bin, one marker whose size says how many events it stands for.
    ``fine``: (lane, fine bin, kind) -> count over the whole trace's time range, counted
    while a trace too big to hold was read (``reduce``), merged into these bins."""
    if not rest and not fine:
        return []
    xs_all = [m.x(e) for e in rest]
    if fine:
        lo, hi = 0.0, m.x_end()
    else:
        lo, hi = min(xs_all), max(xs_all)
    width = (hi - lo) / bins if hi > lo else 1.0
    agg: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for e, x in zip(rest, xs_all):
        b = min(max(int((x - lo) / width), 0), bins - 1)
        agg[(lane(e), b)][e["ev"]] += 1
    if fine:
        from .reduce import FINE_BINS
        for (ln, fb, kind), n in fine.items():
            agg[(ln, min(fb * bins // FINE_BINS, bins - 1))][kind] += n
    ax, ay, asz, ah = [], [], [], []
    for (ln, b), cnt in agg.items():
        n = sum(cnt.values())
        ax.append(lo + (b + 0.5) * width)
        ay.append(ln)
        asz.append(min(4 + 3 * math.log2(1 + n), 22))
        top = ", ".join(f"{k}: {v}" for k, v in cnt.most_common(6))
        ah.append(f"<b>{n} events aggregated</b><br>{lo + b * width:.2f}–{lo + (b + 1) * width:.2f} ms<br>{top}")
    stats["bins"] = len(ax)
    return [{"type": "scattergl" if len(ax) > 5000 else "scatter", "mode": "markers",
             "name": "aggregated events (size = count)", "x": ax, "y": ay, "hovertext": ah,
             "hoverinfo": "text", "marker": {"color": LIGHT_GREY, "size": asz, "opacity": 0.6}}]


def _transfers(m: Model, stats: dict[str, Any]) -> list[dict]:
    """KV transfers P -> D: P request_finished -> D read issued -> D read done."""
    events = m.events
    p_fin = {e["req"]: e for e in events if e["ev"] == "nixl.request_finished" and e.get("side") == "P" and "req" in e}
    reads: dict[str, list[dict]] = collections.defaultdict(list)
    done_by_req: dict[str, dict] = {}
    for e in events:
        if e["ev"] == "nixl.read" and "req" in e:
            reads[e["req"]].append(e)
        elif e["ev"] == "nixl.read_done" and "req" in e:
            done_by_req[e["req"]] = e
    kv: dict[str, tuple[list, list, list]] = {"ok": ([], [], []), "bad": ([], [], [])}
    n_kv = 0
    kv_budget = 200  # transfers without a finding; those with one are always drawn
    kv_items = sorted(reads.items(), key=lambda it: (it[0] not in m.affected_reqs, it[1][0].get("id", 0)))
    if m.totals is not None:  # read in two passes: the transfers past the first ones were not kept
        missing = sum(1 for r in m.totals.reads if r not in reads)
        if missing:
            stats["kv_not_drawn"] = stats.get("kv_not_drawn", 0) + missing
    for dreq, rs in kv_items:
        if n_kv >= kv_budget and dreq not in m.affected_reqs and m.d2p.get(dreq) not in m.affected_reqs:
            stats["kv_not_drawn"] = stats.get("kv_not_drawn", 0) + 1
            continue
        n_kv += 1
        preq = m.d2p.get(dreq, rs[0].get("remote_req") or dreq)
        src = p_fin.get(preq)
        rd = rs[0]
        dn = done_by_req.get(dreq)
        bad = dreq in m.affected_reqs or preq in m.affected_reqs
        X, Y, H = kv["bad" if bad else "ok"]
        txt = (f"<b>KV transfer</b> P {html.escape(str(preq))} → D {html.escape(str(dreq))}<br>"
               f"P blocks {short(rd.get('remote_block_ids'), 120)}<br>D blocks {short(rd.get('local_block_ids'), 120)}"
               f"<br>bytes {rd.get('bytes')}" + (f"<br>status {dn.get('status')}" if dn else ""))
        for e in ([src] if src else []) + [rd] + ([dn] if dn else []):
            X.append(m.x(e))
            Y.append(lane(e))
            H.append(txt)
        X.append(None)
        Y.append(None)
        H.append(None)
    traces = []
    for key, (X, Y, H) in kv.items():
        if X:
            traces.append({"type": "scatter", "mode": "lines+markers", "name": "KV transfer P→D" + (
                " (request with a finding)" if key == "bad" else ""), "x": X, "y": Y, "hovertext": H,
                "hoverinfo": "text", "line": {"color": RED if key == "bad" else GREEN, "width": 2 if key == "bad" else 1},
                "opacity": 1.0 if key == "bad" else 0.45,
                "marker": {"size": 6, "symbol": "arrow-bar-right"}, "connectgaps": False})
    return traces


def timeline(m: Model, budget: int, bins: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figure, stats): stats has events / drawn / aggregated / bins and what was left out."""
    events = m.events
    fine = m.totals.bins if m.totals is not None else None  # a trace read in two passes (reduce)
    if m.totals is not None and m.n_events <= budget:
        fine = None  # every event was kept (reduce.OPENING) and is drawn
    recovery = fig_kvload.recovery_traces(m)
    lanes = sorted({lane(e) for e in events} | (m.totals.lanes if m.totals is not None else set())
                   | {y for t in recovery for y in t["y"] if y}, key=lane_key)
    detail, rest = _split(m, budget)
    aggregated = len(rest)
    if fine:
        aggregated = m.n_events - m.totals.kinds.get("sched.step", 0) - len(detail)
    stats: dict[str, Any] = {"events": m.n_events, "drawn": len(detail), "aggregated": aggregated, "bins": 0}
    traces = _step_bars(m, budget, stats)
    traces += _event_ticks(m, detail)
    traces += _aggregated(m, rest, bins, stats, fine)
    traces += _transfers(m, stats)
    traces += recovery
    traces += finding_markers(m, lambda e: lane(e))
    xaxis: dict[str, Any] = {"title": {"text": "time (ms since first event)"}, "zeroline": False}
    opened = m.findings_range()
    if opened is not None:
        xaxis["range"] = list(opened)
    stats["opened_on"] = opened
    lay = layout("Timeline: engine steps per instance, events, KV transfers P→D",
                 xaxis=xaxis,
                 yaxis={"type": "category", "categoryorder": "array", "categoryarray": lanes[::-1], "automargin": True},
                 barmode="overlay", height=max(480, 70 * len(lanes) + 140))
    return {"data": traces, "layout": lay}, stats
