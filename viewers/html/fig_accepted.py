"""Accepted-token-count figures, one per worker that read accepted counts: InputBatch rows
over time, the request owning each row (batch.add / swap_states / condense), the D2H copies
of num_accepted_tokens (issued, observed complete) and the CPU reads, marked when a read came
before its copy completed or a finding calls it stale."""

from __future__ import annotations

import collections
import html

from .common import BLUE, GREEN, ORANGE, PURPLE, RED, Model, color_of, lane, lane_key, layout, legend


def caption(figs: list[dict]) -> str:
    items = legend(figs, [
        ("copy issued", BLUE, "▶ D2H copy of num_accepted_tokens issued"),
        ("copy completed", GREEN, "◀ its CUDA event observed complete"),
        ("CPU read before", ORANGE, "● CPU read before the copy completed"),
        ("CPU read", GREEN, "● CPU read after the copy completed"),
        ("stale read", RED, "× stale read cited by a finding"),
        ("swap / condense", PURPLE, "◆ swap_states / condense moving a row"),
    ])
    return ("y: InputBatch row; shaded bars: the request owning the row over time (one colour per request, from "
            "batch.add / swap_states / condense)" + (". " + items if items else "") + ".")


def rows_owner(events: list[dict]) -> list[tuple[int, str, float, float | None, str]]:
    """(row, req, x_start, x_end or None, how) intervals from batch events of one worker."""
    owner: dict[int, tuple[str, float, str]] = {}
    out: list[tuple[int, str, float, float | None, str]] = []

    def close(row: int, x: float) -> None:
        cur = owner.pop(row, None)
        if cur is not None:
            out.append((row, cur[0], cur[1], x, cur[2]))

    for x, e in events:
        k = e["ev"]
        if k == "batch.add":
            close(e["row"], x)
            owner[e["row"]] = (str(e.get("req", "?")), x, "add")
        elif k == "batch.remove" and e.get("row", -1) >= 0:
            close(e["row"], x)
        elif k == "batch.swap":
            a, b = owner.get(e["i1"]), owner.get(e["i2"])
            close(e["i1"], x)
            close(e["i2"], x)
            if e.get("req2") or b:
                owner[e["i1"]] = (str(e.get("req2") or b[0]), x, "swap")
            if e.get("req1") or a:
                owner[e["i2"]] = (str(e.get("req1") or a[0]), x, "swap")
        elif k == "batch.condense":
            moved = []
            for mv in e.get("moves") or []:
                if len(mv) >= 3:
                    close(mv[1], x)
                    moved.append((mv[2], str(mv[0])))
            for new, req in moved:
                close(new, x)
                owner[new] = (req, x, "condense")
        elif k == "d2h.issue" and not any(True for _ in owner):
            for r, req in enumerate(e.get("rows") or []):
                if req:
                    owner[r] = (req, x, "d2h.issue rows")
    for row, (req, x0, how) in owner.items():
        out.append((row, req, x0, None, how))
    return out


def accepted(m: Model, budget: int, limit: int) -> tuple[list[tuple[str, dict]], str]:
    kinds = ("d2h.issue", "d2h.done", "acc.read", "acc.truth", "batch.add", "batch.remove", "batch.swap", "batch.condense")
    per: dict[str, list[dict]] = collections.defaultdict(list)
    for e in m.events:
        if e["ev"] in kinds:
            per[lane(e)].append(e)
    stale_ids = {i for f in m.findings if f.kind == "stale-accepted-count-read" for i in f.event_ids}
    stale_steps = {(f.inst, f.step) for f in m.findings if f.kind == "stale-accepted-count-read"}
    figs: list[tuple[str, dict]] = []
    notes: list[str] = []
    for ln in sorted(per, key=lane_key):
        evs = per[ln]
        tot = m.totals  # a trace read in two passes: its counts, not the kept events'
        if not (tot.lane_kind.get((ln, "acc.read")) if tot is not None else any(e["ev"] == "acc.read" for e in evs)):
            continue
        if len(figs) >= limit:
            notes.append(f"{ln} not drawn (limit {limit} workers)")
            continue
        total = tot.lane_total(ln, kinds) if tot is not None else len(evs)
        if total > budget:
            steps = sorted({e["step"] for e in evs if "step" in e and ((e.get("inst"), e["step"]) in stale_steps
                                                                       or e.get("id") in stale_ids)})
            if steps:
                keep = {s + d for s in steps for d in range(-3, 4)}
                evs = [e for e in evs if e.get("step") in keep or e.get("id") in stale_ids]
                why = "steps within ±3 of a stale read"
            else:
                evs = evs[:budget]
                why = "the first events (no stale read found)"
            evs = evs[:budget]
            notes.append(f"{ln}: {len(evs)} of {total} accepted-count / batch events drawn ({why}); "
                         f"{total - len(evs)} left out")
        xe = [(m.x(e), e) for e in evs]
        xmax = max((x for x, _ in xe), default=0.0)
        truth: dict[tuple[str, int], int] = {}
        for e in evs:
            if e["ev"] == "acc.truth" and "req" in e:
                truth[(e["req"], e.get("for_step"))] = e["value"]
        issue_rows: dict[str, tuple[float, list[str]]] = {}
        traces: list[dict] = []
        # row ownership as horizontal bars
        ob, ox, oy, oc, oh, ot = [], [], [], [], [], []
        for row, req, x0, x1, how in rows_owner(xe):
            x1 = xmax + 0.05 if x1 is None else x1
            ob.append(x0)
            ox.append(max(x1 - x0, 1e-3))
            oy.append(row)
            oc.append(color_of(req))
            ot.append(req)
            oh.append(f"row {row} owned by <b>{html.escape(req)}</b><br>{x0:.3f}–{x1:.3f} ms (from {how})")
        if ob:
            traces.append({"type": "bar", "orientation": "h", "base": ob, "x": ox, "y": oy, "name": "row owner",
                           "marker": {"color": oc, "opacity": 0.35}, "text": ot, "textposition": "inside",
                           "insidetextanchor": "start", "hovertext": oh, "hoverinfo": "text", "width": 0.8})
        ix, iy, ih, cx, cy, ch = [], [], [], [], [], []
        for x, e in xe:
            if e["ev"] == "d2h.issue":
                rows = e.get("rows") or []
                issue_rows[e.get("event", "")] = (x, rows)
                for r, req in enumerate(rows):
                    if req:
                        ix.append(x)
                        iy.append(r)
                        ih.append(f"<b>D2H copy issued</b> (event {html.escape(str(e.get('event')))}) step {e.get('step')}"
                                  f"<br>row {r} held {html.escape(req)} at issue")
            elif e["ev"] == "d2h.done":
                rows = issue_rows.get(e.get("event", ""), (0, []))[1]
                for r, req in enumerate(rows or [None]):
                    cx.append(x)
                    cy.append(r)
                    ch.append(f"<b>D2H copy completed</b> (event {html.escape(str(e.get('event')))}) step {e.get('step')}")
        if ix:
            traces.append({"type": "scatter", "mode": "markers", "name": "copy issued", "x": ix, "y": iy,
                           "hovertext": ih, "hoverinfo": "text",
                           "marker": {"symbol": "triangle-right", "size": 10, "color": BLUE}})
        if cx:
            traces.append({"type": "scatter", "mode": "markers", "name": "copy completed", "x": cx, "y": cy,
                           "hovertext": ch, "hoverinfo": "text",
                           "marker": {"symbol": "triangle-left", "size": 10, "color": GREEN}})
        groups = {"ok": ([], [], []), "early": ([], [], []), "stale": ([], [], [])}
        for x, e in xe:
            if e["ev"] != "acc.read":
                continue
            req = e.get("req")
            st = e.get("step")
            tv = truth.get((req, st - 1)) if st is not None else None
            if tv is None and st is not None:
                tv = truth.get((req, st))
            early = e.get("event_done") is False and not e.get("synced")
            stale = e.get("id") in stale_ids
            key = "stale" if stale else ("early" if early else "ok")
            X, Y, H = groups[key]
            X.append(x)
            Y.append(e["row"])
            H.append(f"<b>CPU read</b> req {html.escape(str(req))} row {e['row']} value {e['value']}"
                     f"<br>truth {tv if tv is not None else '?'}; event {html.escape(str(e.get('event')))} "
                     f"done={e.get('event_done')} synced={e.get('synced')}<br>step {st} #{e.get('id')}"
                     + ("<br><b>STALE READ (finding)</b>" if stale else "")
                     + ("<br>read before the copy completed" if early else "")
                     + ("<br><b>value ≠ truth</b>" if tv is not None and tv != e["value"] else ""))
        style = {"ok": ("CPU read", "circle", GREEN, 9), "early": ("CPU read before copy completed", "circle", ORANGE, 11),
                 "stale": ("stale read (finding)", "x", RED, 15)}
        for key, (X, Y, H) in groups.items():
            if X:
                name, sym, col, sz = style[key]
                traces.append({"type": "scatter", "mode": "markers", "name": name, "x": X, "y": Y, "hovertext": H,
                               "hoverinfo": "text", "marker": {"symbol": sym, "size": sz, "color": col,
                                                               "line": {"width": 1, "color": "#333"}}})
        sx, sy, sh = [], [], []
        for x, e in xe:
            if e["ev"] == "batch.swap":
                for r in (e["i1"], e["i2"]):
                    sx.append(x)
                    sy.append(r)
                    sh.append(f"<b>swap_states({e['i1']}, {e['i2']})</b><br>{html.escape(str(e.get('req1')))} ↔ "
                              f"{html.escape(str(e.get('req2')))} step {e.get('step')}")
            elif e["ev"] == "batch.condense":
                for mv in e.get("moves") or []:
                    if len(mv) >= 3:
                        sx.append(x)
                        sy.append(mv[2])
                        sh.append(f"<b>condense</b> {html.escape(str(mv[0]))}: row {mv[1]} → {mv[2]}")
        if sx:
            traces.append({"type": "scatter", "mode": "markers", "name": "swap / condense", "x": sx, "y": sy,
                           "hovertext": sh, "hoverinfo": "text",
                           "marker": {"symbol": "diamond", "size": 11, "color": PURPLE}})
        rows_seen = sorted({y for tr in traces for y in tr.get("y", []) if isinstance(y, int)})
        lay = layout(f"Accepted-token counts on {ln}: D2H copies, CPU reads, row owners",
                         height=max(300, 60 * len(rows_seen) + 160), barmode="overlay",
                         margin={"l": 70, "r": 20, "t": 40, "b": 45},
                         xaxis={"title": {"text": "time (ms since first event)"}},
                         yaxis={"title": {"text": "InputBatch row"}, "dtick": 1, "autorange": "reversed"})
        figs.append((ln, {"data": traces, "layout": lay}))
    return figs, "; ".join(notes)
