"""Where D's prompt tokens came from (issue 51, kv-never-crossed): one horizontal stacked bar per
instance pair: loaded from P, hit in D's own prefix cache, computed on D, planned but lost to a
failed load. The numbers are ``detectors.crossed.Stream.notes`` (what ``pdtrace check`` prints
as "Where D's prompt tokens came from"), over the events the report holds."""

from __future__ import annotations

from typing import Any

from pdtrace.detectors import crossed_groups
from pdtrace.detectors.base import KV_NEVER_CROSSED
from pdtrace.detectors.crossed import pair_notes, short_line, summary_line

from .common import GREEN, GREY, ORANGE, RED, esc, layout

PARTS = (("loaded", "loaded from P", GREEN), ("local_hit", "D's prefix cache", GREY),
         ("computed", "computed on D", ORANGE), ("load_failed_tokens", "recomputed after a failed load", RED))


def figure(pairs: list[dict]) -> dict | None:
    if not pairs:
        return None
    names = [short_line(n).split(";")[0] for n in pairs]  # "P->D: 6 req, 2 without params"
    data = []
    for key, word, colour in PARTS:
        xs = [n.get(key, 0) for n in pairs]
        if not any(xs):
            continue
        data.append({"type": "bar", "orientation": "h", "name": word, "y": names, "x": xs,
                     "marker": {"color": colour},
                     "hovertemplate": "%{y}: %{x} prompt tokens " + word + "<extra></extra>"})
    lay = layout("Prompt tokens per instance pair", barmode="stack", height=120 + 40 * len(pairs),
                 xaxis={"title": {"text": "prompt tokens"}})
    return {"data": data, "layout": lay}


GROUP_PARTS = (("loaded", "loaded into the group", GREEN),
               ("not_loaded", "before the group's loaded tail (sliding / chunked: outside the window)", GREY),
               ("not_transferred", "not a transfer group: counted computed, never written", RED))


def group_figure(pairs: list[dict]) -> dict | None:
    """Per KV cache group of each pair with two or more: of the tokens D loaded, those that reached the group,
    those before its loaded tail, those of a group that does not transfer. None when no pair has two groups."""
    rows = [(short_line(n).split(":")[0], r) for n in pairs for r in (n.get("groups") or [])
            if len(n.get("groups") or []) > 1]
    if not rows:
        return None
    names = [f"{src} · {crossed_groups.name(r)}" for src, r in rows]
    data = [{"type": "bar", "orientation": "h", "name": word, "y": names, "x": [r[key] for _s, r in rows],
             "marker": {"color": colour}, "hovertemplate": "%{y}: %{x} loaded prompt tokens " + word + "<extra></extra>"}
            for key, word, colour in GROUP_PARTS if any(r[key] for _s, r in rows)]
    lay = layout("Loaded prompt tokens per KV cache group", barmode="stack", height=120 + 34 * len(rows),
                 xaxis={"title": {"text": "prompt tokens D loaded (D's hit and D's own compute are every group's)"}})
    return {"data": data, "layout": lay}


def section(trace: Any, fig_div: Any) -> str | None:
    """The report's section, or None when no instance loaded KV (nothing to say). A reduced trace
    (``reduce.read``) carries the streamed check's notes over all its events; else they are
    counted here over the events."""
    held = getattr(trace, "notes", None)
    pairs = list(held.get(KV_NEVER_CROSSED) or []) if isinstance(held, dict) else pair_notes(trace.events)
    fig = figure(pairs)
    if fig is None:
        return None
    lines = "".join(f"<li>{esc(summary_line(n))}" + "".join(
        f"<br>&nbsp;&nbsp;{esc(x)}" for x in crossed_groups.lines(n.get("groups") or [])) + "</li>" for n in pairs)
    gfig = group_figure(pairs)
    return ('<section id="crossing"><h2>Where D\'s prompt tokens came from</h2><p class="note">Per request D '
            "served, from its scheduler's own numbers: its prefix-cache hit and the tokens its connector "
            "planned to load from P at admission (less what a failed load's rollback took back, recomputed on "
            "D), the rest computed on D (kv-never-crossed; a request P prefilled whose D side computed it "
            f"again is a finding).</p><ul>{lines}</ul>" + fig_div("fig-crossing", fig)
            + (fig_div("fig-crossing-groups", gfig) if gfig else "") + "</section>")
