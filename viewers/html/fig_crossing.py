"""Where D's prompt tokens came from (issue 51, kv-never-crossed): one horizontal stacked bar per
instance pair: loaded from P, hit in D's own prefix cache, computed on D, planned but lost to a
failed load. The numbers are ``detectors.crossed.Stream.notes`` (what ``pdtrace check`` prints
as "Where D's prompt tokens came from"), over the events the report holds."""

from __future__ import annotations

from typing import Any

from pdtrace.detectors import crossed_groups
from pdtrace.detectors.base import KV_NEVER_CROSSED
from pdtrace.detectors.crossed import pair_notes, short_line, summary_line

from .common import BLUE, GREEN, GREY, ORANGE, RED, esc, layout

SHOWN_REQUESTS = 4  # block maps drawn per report (the drafter-group findings' first requests)
CELLS = (("loaded", "loaded from P", GREEN), ("hit", "D's prefix cache", BLUE), ("computed", "computed on D", ORANGE),
         ("unwritten", "counted computed, never written (not a transfer group)", RED),
         ("null", "null block (outside the window)", GREY))

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
    lay = layout("Prompt tokens per instance pair", barmode="stack", height=120 + 40 * len(pairs), showlegend=True,
                 xaxis={"title": {"text": "prompt tokens"}}, yaxis={"automargin": True})
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
             "marker": {"color": colour}, "hovertemplate": "%{y}: %{x} of the prompt tokens D loaded: " + word + "<extra></extra>"}
            for key, word, colour in GROUP_PARTS if any(r[key] for _s, r in rows)]
    lay = layout("Loaded prompt tokens per KV cache group", barmode="stack", height=120 + 34 * len(rows), showlegend=True,
                 xaxis={"title": {"text": "prompt tokens D loaded (D's prefix-cache hit and what D computes are the same in "
                                        "every group)"}},
                 yaxis={"automargin": True})
    return {"data": data, "layout": lay}


def _load_events(events: list[dict], reqs: set) -> tuple[dict, dict, dict]:
    """One pass over the events: for each of ``reqs`` its first ``nixl.remote_alloc`` and its first ``sched.alloc``
    that says what its connector loads, and each instance's first ``sched.config``."""
    ras: dict[str, dict] = {}
    firsts: dict[str, dict] = {}
    cfgs: dict[Any, dict] = {}
    for e in events:
        k = e.get("ev")
        if k == "sched.config":
            cfgs.setdefault(e.get("inst"), e)
        elif e.get("req") in reqs:
            if k == "nixl.remote_alloc":
                ras.setdefault(e["req"], e)
            elif k == "sched.alloc" and "num_external_computed_tokens" in e:
                firsts.setdefault(e["req"], e)
    return ras, firsts, cfgs


def request_figure(ra: dict | None, first: dict | None, cfg: dict | None, req: str) -> dict | None:
    """D's blocks for ``req`` per KV cache group, one square per block at its token-block index, coloured by where its
    KV came from: D's whole list at the load (``ra``, its ``nixl.remote_alloc``: ``local_block_ids``, vLLM's), the
    blocks its connector loads into (``load_block_ids``), D's hit and the tokens it loaded (``first``, its first
    ``sched.alloc``), the transfer groups (``cfg``, D's ``sched.config``). None when the trace lacks any of them."""
    if ra is None or first is None or cfg is None:
        return None
    local, ext = int(first.get("num_new_computed_tokens") or 0), int(first.get("num_external_computed_tokens") or 0)
    groups = crossed_groups.groups_of(cfg)
    loads = ra.get("load_block_ids") or []
    cells: dict[str, tuple[list, list, list, list]] = {key: ([], [], [], []) for key, _w, _c in CELLS}
    names = []
    width = max((len(b) for b in ra.get("local_block_ids") or []), default=0)
    for gi, blocks in zip(groups, ra.get("local_block_ids") or []):
        name = crossed_groups.name(gi)
        names.append(name)
        ti = gi["ti"]
        loading = set(loads[ti]) if gi["transfer"] and ti is not None and ti < len(loads) else None
        bs = gi["block_size"] or 16
        for k, b in enumerate(blocks):
            lo = k * bs
            key = ("null" if b == 0 else "hit" if lo < local else "computed" if lo >= local + ext
                   else "unwritten" if not gi["transfer"] else "loaded" if loading is None or b in loading else "computed")
            xs, ys, ts, hs = cells[key]
            xs.append(k)
            ys.append(name)
            ts.append(str(b))
            hi = lo + bs - 1 if lo >= local + ext else min(lo + bs, local + ext) - 1  # (the loaded range's last block)
            hs.append(f"{name}: D block {b}, tokens {lo}-{hi}: {dict((c[0], c[1]) for c in CELLS)[key]}")
    data = [{"type": "scatter", "mode": "markers+text", "name": word, "x": xs, "y": ys, "text": ts,
             "textposition": "middle center", "hovertext": hs, "hoverinfo": "text",
             "textfont": {"color": "white"}, "marker": {"symbol": "square", "size": 26, "color": colour}}
            for key, word, colour in CELLS for xs, ys, ts, hs in [cells[key]] if xs]
    lay = layout(f"D {req}: its blocks per KV cache group ({ext} prompt tokens loaded, {local} from D's cache)",
                 height=140 + 50 * len(names),
                 xaxis={"title": {"text": "token-block index"}, "dtick": 1, "range": [-0.6, max(width, 4) - 0.4]},
                 yaxis={"categoryorder": "array", "categoryarray": names[::-1], "automargin": True})
    return {"data": data, "layout": lay}


def section(trace: Any, fig_div: Any, findings: list | None = None) -> str | None:
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
            + (fig_div("fig-crossing-groups", gfig) if gfig else "") + _request_maps(trace, fig_div, findings)
            + "</section>")


def drafter_requests(findings: list | None) -> list[str]:
    """The requests of kv-never-crossed's drafter-group findings, in order."""
    return [f.req for f in findings or () if f.kind == KV_NEVER_CROSSED and f.req
            and (getattr(f, "data", None) or {}).get("mechanism") == "drafter-group"]


def _request_maps(trace: Any, fig_div: Any, findings: list | None) -> str:
    """Block maps of the first requests whose drafter group never got its KV (kv-never-crossed's error)."""
    reqs = drafter_requests(findings)
    shown = list(dict.fromkeys(reqs))[:SHOWN_REQUESTS]
    ras, firsts, cfgs = _load_events(trace.events, set(shown))
    out = []
    for i, req in enumerate(shown):
        ra = ras.get(req)
        fig = request_figure(ra, firsts.get(req), cfgs.get((ra or {}).get("inst")), req)
        if fig is not None:
            out.append(f'<h3 id="crossing-{esc(req)}">{esc(req)}</h3>' + fig_div(f"fig-crossing-req-{i}", fig))
    if not out:
        return ""
    more = f" (the first {SHOWN_REQUESTS} of {len(set(reqs))})" if len(set(reqs)) > SHOWN_REQUESTS else ""
    return (f"<p class=\"note\">D's blocks per KV cache group for the requests whose drafter group got none of the "
            f"loaded tokens{more}: a square per block at its token-block index, its id inside.</p>" + "".join(out))
