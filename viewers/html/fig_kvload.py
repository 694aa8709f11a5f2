"""KV that failed to load (issue 36): one block map per request a failed load touched, and the
recovery as a row of the timeline.

The block map: x is the request's logical block index on D (tick label: D's block id), one row
of markers per decision the scheduler took (``kvload.request``): the blocks whose load failed, the
blocks it held, the computed tokens before and after (the recompute restarts at the dashed line).
The timeline row (``<inst> KV load recovery``): per request, the failed load, the step that
schedules it again, its finish. Everything from the recorded events; nothing from vLLM here."""

from __future__ import annotations

import collections
from typing import Any

from .common import GREEN, GREY, ORANGE, RED, Model, esc, layout, legend

KINDS = ("kvload.handled", "kvload.request", "kvload.error", "kvload.reported")


def caption(figs: list[dict], note: str) -> str:
    items = legend(figs, [
        ("failed to load", RED, "×: a block the connector reported failed"),
        ("held", GREEN, "●: a block the request held, loaded or computed"),
        ("restart", ORANGE, "dashed line: where the scheduler left its computed tokens (the recompute "
         "starts there; under policy fail the request ends)"),
    ])
    return ("x: logical block index of the request on D (tick: D block id); one row per scheduler decision. "
            + (items + ". " if items else "") + f"{esc(note)}.")


def failures(m: Model) -> dict[tuple, dict[str, Any]]:
    """(inst, req) -> {"decisions": [(kvload.request, its kvload.handled)], "finish": req.finish,
    "again": the first sched.step after the failure that schedules it}, in trace order."""
    handled: dict[tuple, dict] = {}
    out: dict[tuple, dict[str, Any]] = {}
    pending: dict[Any, dict[str, int]] = collections.defaultdict(dict)  # inst -> req -> failure step: not yet again
    for e in m.events:
        k = e["ev"]
        if k == "kvload.handled":
            handled[(e.get("pid"), e.get("step"), e.get("source"))] = e
        elif k == "kvload.request" and "req" in e:
            h = handled.get((e.get("pid"), e.get("step"), e.get("source")), {})
            st = out.setdefault((e.get("inst"), e["req"]), {"decisions": []})
            st["decisions"].append((e, h))
            if "again" not in st:
                pending[e.get("inst")].setdefault(e["req"], e.get("step", -1))
        elif k == "req.finish" and (e.get("inst"), e.get("req")) in out:
            out[(e.get("inst"), e["req"])].setdefault("finish", e)
            pending[e.get("inst")].pop(e["req"], None)
        elif k == "sched.step" and pending.get(e.get("inst")):
            waiting = pending[e.get("inst")]
            for req in [r for r in (e.get("tokens") or {}) if r in waiting and e.get("step", -1) > waiting[r]]:
                out[(e.get("inst"), req)]["again"] = e
                del waiting[req]
    return out


def load_maps(m: Model, limit: int) -> tuple[list[tuple[str, str, dict]], str]:
    """One figure per request a failed load touched (the first ``limit``)."""
    bs_of: dict[str, int] = {}
    for e in m.events:
        if e["ev"] == "sched.config" and e.get("block_sizes"):
            bs_of.setdefault(e.get("inst", "-"), int(e["block_sizes"][0]))
    got = failures(m)
    out = []
    for (inst, req), st in list(got.items())[:limit]:
        bs = bs_of.get(inst)
        traces: list[dict] = []
        rows: list[str] = []
        ticks: dict[int, str] = {}
        for e, h in st["decisions"]:
            row = f"step {e.get('step')} {e.get('source')}"
            rows.append(row)
            blocks = (e.get("block_ids") or [[]])[0]
            bad = set(h.get("block_ids") or ()) if h.get("block_ids") else (set(blocks) if e.get("source") ==
                                                                             "failed_recving" else set())
            for i, b in enumerate(blocks):
                ticks.setdefault(i, f"{i}<br>D{b}")
            for name, color, symbol, sel in (("failed to load", RED, "x", True), ("held", GREEN, "circle", False)):
                xs = [i for i, b in enumerate(blocks) if (b in bad) == sel]
                if xs:
                    traces.append({"type": "scatter", "mode": "markers", "name": name, "x": xs, "y": [row] * len(xs),
                                   "legendgroup": name, "showlegend": not any(t.get("name") == name for t in traces),
                                   "hoverinfo": "text", "marker": {"size": 14, "color": color, "symbol": symbol},
                                   "hovertext": [f"D block {blocks[i]} (logical {i}"
                                                 + (f", tokens {i * bs}–{(i + 1) * bs - 1}" if bs else "") + ")"
                                                 + ("<br><b>load failed</b>" if sel else "") for i in xs]})
            if bs:
                for val, dash, what in ((e.get("computed_before"), "dot", "computed before"),
                                        (e.get("computed"), "dash", "computed after (restart)")):
                    if val is None:
                        continue
                    x = val / bs - 0.5
                    traces.append({"type": "scatter", "mode": "lines", "name": what, "x": [x, x],
                                   "y": [row, row], "showlegend": False, "hoverinfo": "text",
                                   "hovertext": f"{what}: {val} tokens",
                                   "line": {"color": ORANGE if dash == "dash" else GREY, "dash": dash, "width": 3}})
                    traces.append({"type": "scatter", "mode": "markers+text", "x": [x], "y": [row],
                                   "text": [f"{val}"], "textposition": "top center", "showlegend": False,
                                   "hoverinfo": "text", "hovertext": f"{what}: {val} tokens",
                                   "marker": {"size": 16, "symbol": "line-ns", "color": ORANGE if dash == "dash" else GREY,
                                              "line": {"width": 3, "color": ORANGE if dash == "dash" else GREY}}})
        first = st["decisions"][0][0]
        fin = st.get("finish")
        did = ("failed" if first.get("action") == "fail" else
               f"computed tokens {first.get('computed_before')} → {first.get('computed')}")
        title = (f"KV load failure: {inst} {req}: policy {first.get('policy')}, {did}; "
                 + (f"finished {fin.get('status')} at step {fin.get('step')}" if fin else "no finish in the trace"))
        tv = sorted(ticks)
        lay = layout(title, height=140 + 60 * len(rows), margin={"l": 190, "r": 20, "t": 40, "b": 60},
                     xaxis={"title": {"text": "logical block index (tick: D block id)"}, "dtick": 1,
                            "tickvals": tv or None, "ticktext": [ticks[v] for v in tv] or None},
                     yaxis={"type": "category", "categoryorder": "array", "categoryarray": rows[::-1]})
        out.append((req, title, {"data": traces, "layout": lay}))
    note = f"{len(got)} request(s) hit a failed KV load"
    if len(got) > limit:
        note += f"; the first {limit} are drawn"
    return out, note


def recovery_lane(inst: str) -> str:
    return f"{inst} KV load recovery"


def recovery_traces(m: Model) -> list[dict]:
    """The timeline's recovery rows: per request, failed load (×) -> scheduled again (●) ->
    finished (■), joined by a line; red when the request has a finding."""
    X: dict[bool, list] = collections.defaultdict(list)
    Y: dict[bool, list] = collections.defaultdict(list)
    H: dict[bool, list] = collections.defaultdict(list)
    S: dict[bool, list] = collections.defaultdict(list)
    for (inst, req), st in failures(m).items():
        bad = req in m.affected_reqs
        first = st["decisions"][0][0]
        did = ("failed by the policy" if first.get("action") == "fail" else
               f"computed tokens {first.get('computed_before')} → {first.get('computed')}")
        pts = [(first, "x", f"<b>KV load failed</b> {esc(req)}<br>step {first.get('step')}, policy "
                            f"{first.get('policy')}: {did}")]
        if st.get("again"):
            pts.append((st["again"], "circle", f"{esc(req)} scheduled again at step {st['again'].get('step')}"))
        if st.get("finish"):
            f = st["finish"]
            pts.append((f, "square", f"{esc(req)} finished {f.get('status')} at step {f.get('step')}, "
                                     f"{f.get('num_output_tokens')} output token(s)"))
        for e, sym, txt in pts:
            X[bad].append(m.x(e))
            Y[bad].append(recovery_lane(inst))
            H[bad].append(txt)
            S[bad].append(sym)
        X[bad].append(None)
        Y[bad].append(None)
        H[bad].append(None)
        S[bad].append("circle")
    return [{"type": "scatter", "mode": "lines+markers", "name": "KV load recovery" + (" (request with a finding)"
                                                                                        if bad else ""),
             "x": X[bad], "y": Y[bad], "hovertext": H[bad], "hoverinfo": "text", "connectgaps": False,
             "line": {"color": RED if bad else ORANGE, "width": 2},
             "marker": {"size": 10, "symbol": S[bad], "color": RED if bad else ORANGE}} for bad in (False, True) if X[bad]]
