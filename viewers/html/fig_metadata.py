"""Connector-metadata figures, one per worker: target / drafter forward phases, the span
during which connector metadata is bound (bind -> clear), save_kv_layer calls and
has_connector_metadata() answers per step. A drafter forward with no metadata bound cannot
save its KV."""

from __future__ import annotations

import collections
import html

from .common import (DARK_GREY, DRAFTER_FWD, GREEN, META_BOUND, RED, SAVE_DRAFTER, SAVE_TARGET, TARGET_FWD, Model,
                     finding_markers, lane, lane_key, layout, legend)


def caption(figs: list[dict]) -> str:
    items = legend(figs, [
        ("target forward", TARGET_FWD, "bars: target forward"),
        ("drafter forward", DRAFTER_FWD, "bars: drafter forward"),
        ("metadata bound", META_BOUND, "bars: connector metadata bound (bind → clear)"),
        ("save_kv_layer (target)", SAVE_TARGET, "● save_kv_layer in the target forward"),
        ("save_kv_layer (drafter)", SAVE_DRAFTER, "● save_kv_layer in the drafter forward"),
        ("clear", DARK_GREY, "| clear_connector_metadata"),
        ("has_connector_metadata() = True", GREEN, "● has_connector_metadata() answered True"),
        ("has_connector_metadata() = False", RED, "× has_connector_metadata() answered False"),
        ("drafter began after clear", RED, "× a drafter forward that began after the clear"),
        ("finding", RED, "× events a finding cites"),
    ])
    return ("Per worker and step: forward phases, connector-metadata binding, save_kv_layer calls and "
            "has_connector_metadata() answers; a drafter forward with no metadata bound cannot save its KV"
            + (". " + items if items else "") + ".")


META_LANES = ["target forward", "drafter forward", "metadata bound", "save_kv_layer", "has_connector_metadata()",
               "clear_connector_metadata"]


def metadata(m: Model, max_steps: int, limit: int) -> tuple[list[tuple[str, dict]], str]:
    kinds = ("kvmeta.bind", "kvmeta.clear", "kvmeta.has", "kvmeta.save_layer", "kvmeta.wait_for_save", "spec.phase")
    per: dict[str, list[dict]] = collections.defaultdict(list)
    for e in m.events:
        if e["ev"] in kinds:
            per[lane(e)].append(e)
    meta_find = {(f.inst, f.step) for f in m.findings if f.kind == "connector-metadata-cleared-before-drafter"}
    figs: list[tuple[str, dict]] = []
    notes: list[str] = []
    for ln in sorted(per, key=lane_key):
        evs = per[ln]
        steps = sorted({e["step"] for e in evs if "step" in e})
        n_steps = m.totals.meta_step_count(ln) if m.totals is not None else len(steps)  # the trace's count
        if len(figs) >= limit:
            notes.append(f"{ln} not drawn (limit {limit} workers)")
            continue
        if n_steps > max_steps:
            bad = sorted({s for (i, s) in meta_find if i == evs[0].get("inst")} & set(steps))
            keep = set()
            for s in bad:
                keep.update(range(s - 2, s + 3))
            for s in steps:
                if len(keep) >= max_steps:
                    break
                keep.add(s)
            evs = [e for e in evs if e.get("step") in keep or "step" not in e]
            notes.append(f"{ln}: {len(keep & set(steps))} of {n_steps} steps drawn "
                         f"({'steps around findings, then ' if bad else ''}the first steps)")
        traces: list[dict] = []
        bars: dict[str, list] = {n: [[], [], [], [], []] for n in META_LANES[:3]}
        open_phase: dict[str, tuple[float, dict]] = {}
        bound: tuple[float, dict] | None = None
        pts: dict[str, list] = collections.defaultdict(lambda: [[], [], [], [], []])  # x, y, hover, color, symbol
        save_count: collections.Counter = collections.Counter()
        cleared_at: float | None = None
        for e in evs:
            x = m.x(e)
            k = e["ev"]
            if k == "spec.phase":
                name = f"{e['phase']} forward"
                if e["edge"] == "begin":
                    open_phase[e["phase"]] = (x, e)
                    if e["phase"] == "drafter" and bound is None and cleared_at is not None:
                        P = pts["drafter began after clear"]
                        P[0].append(x), P[1].append("drafter forward"), P[2].append(
                            f"<b>drafter began with no connector metadata</b> (cleared at {cleared_at:.3f} ms) step {e.get('step')}")
                        P[3].append(RED), P[4].append("x")
                elif e["phase"] in open_phase and name in bars:
                    x0, b = open_phase.pop(e["phase"])
                    B = bars[name]
                    B[0].append(x0), B[1].append(max(x - x0, 1e-3)), B[2].append(name)
                    B[3].append(f"<b>{name}</b> step {b.get('step')} {html.escape(str(b.get('method') or ''))}"
                                f"<br>{x0:.3f}–{x:.3f} ms; save_kv_layer calls: {save_count[e['phase']]}")
                    B[4].append(TARGET_FWD if e["phase"] == "target" else DRAFTER_FWD)
                    save_count[e["phase"]] = 0
            elif k == "kvmeta.bind":
                bound = (x, e)
                cleared_at = None
            elif k == "kvmeta.clear":
                if bound is not None:
                    x0, b = bound
                    B = bars["metadata bound"]
                    B[0].append(x0), B[1].append(max(x - x0, 1e-3)), B[2].append("metadata bound")
                    B[3].append(f"<b>connector metadata bound</b> step {b.get('step')}<br>recv {b.get('n_recv')} save "
                                f"{b.get('n_save')} send {b.get('n_send')}<br>{x0:.3f}–{x:.3f} ms")
                    B[4].append(META_BOUND)
                bound = None
                cleared_at = x
                during = [p for p in open_phase] or [""]
                P = pts["clear"]
                early = "drafter" not in open_phase and e.get("phase", "") != "drafter"
                P[0].append(x), P[1].append("clear_connector_metadata"), P[2].append(
                    f"<b>clear_connector_metadata</b> {html.escape(('phase ' + e['phase']) if e.get('phase') else 'between the model phases')} step {e.get('step')}"
                    f"<br>open phases: {', '.join(during)}")
                P[3].append(DARK_GREY), P[4].append("line-ns-open" if early else "line-ns-open")
            elif k == "kvmeta.save_layer":
                save_count[e.get("phase", "")] += 1
                P = pts[f"save_kv_layer ({e.get('phase')})"]
                P[0].append(x), P[1].append("save_kv_layer"), P[2].append(
                    f"save_kv_layer {html.escape(str(e.get('layer')))} phase {e.get('phase')} step {e.get('step')}")
                P[3].append(SAVE_TARGET if e.get("phase") == "target" else SAVE_DRAFTER), P[4].append("circle")
            elif k == "kvmeta.has":
                key = "has_connector_metadata() = False" if not e.get("result") else "has_connector_metadata() = True"
                P = pts[key]
                P[0].append(x), P[1].append("has_connector_metadata()"), P[2].append(
                    f"has_connector_metadata() → {e.get('result')} phase {e.get('phase')} step {e.get('step')}")
                P[3].append(RED if not e.get("result") else GREEN), P[4].append("x" if not e.get("result") else "circle")
        for name, (b, w, y, h, c) in bars.items():
            if b:
                traces.append({"type": "bar", "orientation": "h", "base": b, "x": w, "y": y, "name": name,
                               "hovertext": h, "hoverinfo": "text", "marker": {"color": c}, "width": 0.6})
        for name, (x, y, h, c, s) in pts.items():
            traces.append({"type": "scatter", "mode": "markers", "name": name, "x": x, "y": y, "hovertext": h,
                           "hoverinfo": "text", "marker": {"color": c, "symbol": s, "size": 9 if "False" not in name else 12,
                                                           "line": {"width": 2, "color": c}}})
        ids = {e.get("id") for e in evs}
        traces.extend(finding_markers(m, lambda e: "clear_connector_metadata" if e["ev"] == "kvmeta.clear" else (
            "has_connector_metadata()" if e["ev"] == "kvmeta.has" else (
                "drafter forward" if e["ev"] == "spec.phase" else None)), ids=ids))
        lay = layout(f"Connector metadata and model phases per step on {ln}", height=360, barmode="overlay",
                         xaxis={"title": {"text": "time (ms since first event)"}},
                         yaxis={"type": "category", "categoryorder": "array", "categoryarray": META_LANES[::-1],
                                "automargin": True})
        figs.append((ln, {"data": traces, "layout": lay}))
    return figs, "; ".join(notes)
