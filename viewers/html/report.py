"""The self-contained Plotly HTML report (``pdtrace report``).

``render(trace, findings, ...)`` returns one HTML document that works offline: plotly.js
(read from the installed ``plotly`` package, never a CDN) and the figure data are stored
gzip-compressed + base64 inside the page and unpacked by the browser with
``DecompressionStream`` (Chromium 80+, Firefox 113+, Safari 16.4+). The page stays under
``max_bytes`` for any trace size: events far from findings are aggregated into time bins
and the page says how many.

Sections: findings summary, timeline of steps per instance with KV transfers P->D, a
block-mapping figure per affected request, accepted-count rows over time, connector
metadata phases per step, drafter KV write windows.

No vLLM / torch import here: the report reads only trace events.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import gzip
import html
import importlib.util
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import orjson

from .coverage_section import coverage_html, no_findings_line

MAX_BYTES = 5_000_000  # the whole page
DEFAULT_POINT_BUDGET = 30_000  # individually drawn events in the timeline
_TEMPLATE = Path(__file__).with_name("template.html")

_CATEGORY = {  # event kind prefix -> (legend name, colour)
    "sched": ("scheduler", "#1f77b4"),
    "req": ("scheduler", "#1f77b4"),
    "nixl": ("NIXL connector", "#2ca02c"),
    "kvmeta": ("connector metadata", "#9467bd"),
    "spec": ("spec decode", "#8c564b"),
    "d2h": ("accepted counts", "#ff7f0e"),
    "acc": ("accepted counts", "#ff7f0e"),
    "batch": ("input batch", "#17becf"),
}
_OTHER = ("process / marks", "#7f7f7f")
_RED = "#d62728"
_ORANGE = "#ff7f0e"
_GREEN = "#2ca02c"
_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
            "#aec7e8", "#98df8a", "#c5b0d5", "#c49c94"]


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------

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
    """The figure data embedded in a report page (for tests and tools)."""
    start = page.index('<script id="pd-data" type="application/octet-stream">') + len(
        '<script id="pd-data" type="application/octet-stream">')
    end = page.index("</script>", start)
    return orjson.loads(gzip.decompress(base64.b64decode(page[start:end].strip())))


def _cat(kind: str) -> tuple[str, str]:
    return _CATEGORY.get(kind.split(".", 1)[0], _OTHER)


def _short(obj: Any, limit: int = 400) -> str:
    s = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode()
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _hover(e: dict[str, Any]) -> str:
    head = f"<b>{html.escape(e['ev'])}</b> #{e.get('id')}"
    parts = [head, f"{e.get('inst')} {e.get('role')}" + (f" rank {e['rank']}" if "rank" in e else "")
             + f" pid {e.get('pid')}"]
    if "step" in e:
        parts.append(f"step {e['step']}")
    if "req" in e:
        parts.append(f"req {html.escape(str(e['req']))}")
    rest = {k: v for k, v in e.items() if k not in ("ev", "t", "w", "pid", "role", "inst", "rank", "step", "req", "id")}
    if rest:
        body = html.escape(_short(rest, 360))
        parts.append("<br>".join(body[i:i + 90] for i in range(0, len(body), 90)))
    return "<br>".join(parts)


def _lane(e: dict[str, Any]) -> str:
    role = e.get("role", "?")
    if "rank" in e:
        return f"{e.get('inst', '-')} {role} r{e['rank']}"
    return f"{e.get('inst', '-')} {role}"


def _lane_key(name: str) -> tuple:
    inst = name.split(" ", 1)[0]
    order = {"P": 0, "PD": 1, "D": 2}.get(inst, 3)
    return (order, name)


def _color_of(name: str) -> str:
    h = 0
    for ch in str(name):
        h = (h * 131 + ord(ch)) & 0xFFFFFFFF
    return _PALETTE[h % len(_PALETTE)]


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


@dataclasses.dataclass
class FindingView:
    kind: str
    severity: str
    req: str | None
    step: int | None
    inst: str | None
    event_ids: list[int]
    title: str
    explanation: str
    data: dict[str, Any]

    @classmethod
    def of(cls, f: Any) -> "FindingView":
        d = f.to_dict() if hasattr(f, "to_dict") else dict(f)
        return cls(d.get("kind", "?"), d.get("severity", "?"), d.get("req"), d.get("step"), d.get("inst"),
                   list(d.get("event_ids") or []), d.get("title", ""), d.get("explanation", ""),
                   dict(d.get("data") or {}))


# --------------------------------------------------------------------------------------
# the model the figures are drawn from
# --------------------------------------------------------------------------------------

class _Model:
    def __init__(self, events: list[dict[str, Any]], findings: list[FindingView]):
        self.events = events
        self.findings = findings
        self.by_id = {e.get("id", i): e for i, e in enumerate(events)}
        use_w = all("w" in e for e in events[:1000])
        key = "w" if use_w else "t"
        self.tkey = key
        self.t0 = min((e[key] for e in events), default=0)
        self.finding_reqs = {f.req for f in findings if f.req}
        self.finding_ids = sorted({i for f in findings for i in f.event_ids})
        self.finding_steps = {(f.inst, f.step) for f in findings if f.step is not None}
        # D request -> P request (remote_request_id)
        self.d2p: dict[str, str] = {}
        for e in events:
            k = e["ev"]
            if k == "req.add" and isinstance(e.get("kv"), dict) and e["kv"].get("remote_request_id") and "req" in e:
                self.d2p[e["req"]] = str(e["kv"]["remote_request_id"])
            elif k in ("nixl.remote_alloc", "nixl.read") and e.get("remote_req") and "req" in e:
                self.d2p.setdefault(e["req"], str(e["remote_req"]))
        self.p2d = {p: d for d, p in self.d2p.items()}
        self.affected_reqs = set(self.finding_reqs)
        for r in list(self.finding_reqs):
            if r in self.d2p:
                self.affected_reqs.add(self.d2p[r])
            if r in self.p2d:
                self.affected_reqs.add(self.p2d[r])

    def x(self, e: dict[str, Any]) -> float:
        return (e[self.tkey] - self.t0) / 1e6  # ms

    def near_finding(self, e: dict[str, Any], radius: int = 64) -> bool:
        if e.get("req") in self.affected_reqs:
            return True
        if (e.get("inst"), e.get("step")) in self.finding_steps:
            return True
        ids = self.finding_ids
        if not ids:
            return False
        import bisect

        i = e.get("id", -1)
        j = bisect.bisect_left(ids, i)
        return (j < len(ids) and ids[j] - i <= radius) or (j > 0 and i - ids[j - 1] <= radius)


# --------------------------------------------------------------------------------------
# figures (plain plotly.js JSON: {"data": [...], "layout": {...}})
# --------------------------------------------------------------------------------------

def _layout(title: str, **kw: Any) -> dict[str, Any]:
    lay = {"title": {"text": title, "font": {"size": 15}}, "hovermode": "closest", "template": None,
           "margin": {"l": 150, "r": 20, "t": 40, "b": 45}, "legend": {"orientation": "v", "x": 1.01, "y": 1},
           "plot_bgcolor": "#fafafa", "paper_bgcolor": "#ffffff", "font": {"family": "sans-serif", "size": 12}}
    lay.update(kw)
    return lay


def _timeline(m: _Model, budget: int, bins: int) -> tuple[dict[str, Any], dict[str, Any]]:
    events = m.events
    lanes = sorted({_lane(e) for e in events}, key=_lane_key)
    detail: list[dict[str, Any]] = []
    rest: list[dict[str, Any]] = []
    if len(events) <= budget:
        detail = [e for e in events if e["ev"] != "sched.step"]
    else:
        for e in events:
            if e["ev"] == "sched.step":
                continue
            (detail if m.near_finding(e) else rest).append(e)
        if len(detail) > budget:  # keep the events closest to the cited ones
            keep = set(m.finding_ids)
            rest.extend(e for e in detail[budget:] if e.get("id") not in keep)
            detail = detail[:budget] + [e for e in detail[budget:] if e.get("id") in keep]
    stats = {"events": len(events), "drawn": len(detail), "aggregated": len(rest), "bins": 0}
    traces: list[dict[str, Any]] = []

    # steps as bars on the engine-core lanes (aggregated when there are too many)
    steps = [e for e in events if e["ev"] == "sched.step"]
    by_lane: dict[str, list[dict]] = collections.defaultdict(list)
    for e in steps:
        by_lane[_lane(e)].append(e)
    step_budget = max(200, budget // 4)
    for lane, ss in by_lane.items():
        ss.sort(key=lambda e: e[m.tkey])
        if len(ss) > step_budget:
            keep_idx = [i for i, e in enumerate(ss) if m.near_finding(e)][:step_budget]
            stats["aggregated_steps"] = stats.get("aggregated_steps", 0) + len(ss) - len(keep_idx)
        else:
            keep_idx = list(range(len(ss)))
        xs, base, ys, hv, colors = [], [], [], [], []
        for i in keep_idx:
            e = ss[i]
            x0 = m.x(e)
            x1 = m.x(ss[i + 1]) if i + 1 < len(ss) else x0 + 0.05
            base.append(x0)
            xs.append(max(x1 - x0, 1e-3))
            ys.append(lane)
            bad = (e.get("inst"), e.get("step")) in m.finding_steps
            colors.append("#f4a6a6" if bad else ("#c6dbef" if e.get("step", 0) % 2 else "#9ecae1"))
            hv.append(_hover(e))
        if xs:
            traces.append({"type": "bar", "orientation": "h", "base": base, "x": xs, "y": ys, "name": "engine steps",
                           "legendgroup": "steps", "showlegend": lane == next(iter(by_lane)),
                           "marker": {"color": colors, "line": {"width": 0.5, "color": "#ffffff"}},
                           "hovertext": hv, "hoverinfo": "text", "width": 0.5, "opacity": 0.7})

    # individual events, one trace per category
    cats: dict[str, dict[str, Any]] = {}
    for e in detail:
        name, color = _cat(e["ev"])
        tr = cats.get(name)
        if tr is None:
            tr = cats[name] = {"type": "scattergl" if len(detail) > 5000 else "scatter", "mode": "markers",
                               "name": name, "x": [], "y": [], "hovertext": [], "hoverinfo": "text",
                               "marker": {"color": color, "size": 7, "symbol": "line-ns-open", "line": {"width": 2}}}
        tr["x"].append(m.x(e))
        tr["y"].append(_lane(e))
        tr["hovertext"].append(_hover(e))
    traces.extend(cats.values())

    # aggregated events: per lane, per time bin, one marker whose size says how many
    if rest:
        xs_all = [m.x(e) for e in rest]
        lo, hi = min(xs_all), max(xs_all)
        width = (hi - lo) / bins if hi > lo else 1.0
        agg: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
        for e, x in zip(rest, xs_all):
            b = min(int((x - lo) / width), bins - 1)
            agg[(_lane(e), b)][e["ev"]] += 1
        ax, ay, asz, ah = [], [], [], []
        for (lane, b), cnt in agg.items():
            n = sum(cnt.values())
            ax.append(lo + (b + 0.5) * width)
            ay.append(lane)
            asz.append(min(4 + 3 * math.log2(1 + n), 22))
            top = ", ".join(f"{k}: {v}" for k, v in cnt.most_common(6))
            ah.append(f"<b>{n} events aggregated</b><br>{lo + b * width:.2f}–{lo + (b + 1) * width:.2f} ms<br>{top}")
        stats["bins"] = len(ax)
        traces.append({"type": "scattergl" if len(ax) > 5000 else "scatter", "mode": "markers",
                       "name": "aggregated events (size = count)", "x": ax, "y": ay, "hovertext": ah,
                       "hoverinfo": "text", "marker": {"color": "#bbbbbb", "size": asz, "opacity": 0.6}})

    # KV transfers P -> D: P request_finished -> D read issued -> D read done
    p_fin = {e["req"]: e for e in events if e["ev"] == "nixl.request_finished" and e.get("side") == "P" and "req" in e}
    reads: dict[str, list[dict]] = collections.defaultdict(list)
    done_by_req: dict[str, dict] = {}
    for e in events:
        if e["ev"] == "nixl.read" and "req" in e:
            reads[e["req"]].append(e)
        elif e["ev"] == "nixl.read_done" and "req" in e:
            done_by_req[e["req"]] = e
    kv = {"ok": ([], [], []), "bad": ([], [], [])}
    n_kv = 0
    kv_budget = 200  # transfers without a finding; those with one are always drawn
    kv_items = sorted(reads.items(), key=lambda it: (it[0] not in m.affected_reqs, it[1][0].get("id", 0)))
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
               f"P blocks {_short(rd.get('remote_block_ids'), 120)}<br>D blocks {_short(rd.get('local_block_ids'), 120)}"
               f"<br>bytes {rd.get('bytes')}" + (f"<br>status {dn.get('status')}" if dn else ""))
        pts = ([src] if src else []) + [rd] + ([dn] if dn else [])
        for e in pts:
            X.append(m.x(e))
            Y.append(_lane(e))
            H.append(txt)
        X.append(None)
        Y.append(None)
        H.append(None)
    for key, (X, Y, H) in kv.items():
        if X:
            traces.append({"type": "scatter", "mode": "lines+markers", "name": "KV transfer P→D" + (
                " (request with a finding)" if key == "bad" else ""), "x": X, "y": Y, "hovertext": H,
                "hoverinfo": "text", "line": {"color": _RED if key == "bad" else _GREEN, "width": 2 if key == "bad" else 1},
                "opacity": 1.0 if key == "bad" else 0.45,
                "marker": {"size": 6, "symbol": "arrow-bar-right"}, "connectgaps": False})

    traces.extend(_finding_markers(m, lambda e: _lane(e)))
    height = max(480, 70 * len(lanes) + 140)
    layout = _layout("Timeline: engine steps per instance, events, KV transfers P→D",
                     xaxis={"title": {"text": "time (ms since first event)"}, "zeroline": False},
                     yaxis={"type": "category", "categoryorder": "array", "categoryarray": lanes[::-1],
                            "automargin": True},
                     barmode="overlay", height=height)
    return {"data": traces, "layout": layout}, stats


def _finding_markers(m: _Model, yof, only: Iterable[str] | None = None, ids: set | None = None) -> list[dict]:
    X, Y, H = [], [], []
    only = set(only) if only is not None else None
    for f in m.findings:
        if only is not None and f.kind not in only:
            continue
        for i in f.event_ids[:20]:
            e = m.by_id.get(i)
            if e is None or (ids is not None and i not in ids):
                continue
            y = yof(e)
            if y is None:
                continue
            X.append(m.x(e))
            Y.append(y)
            H.append(f"<b>{html.escape(f.severity)}: {html.escape(f.title)}</b><br>{html.escape(f.kind)}"
                     f"<br>event #{i} {html.escape(e['ev'])}")
    if not X:
        return []
    return [{"type": "scatter", "mode": "markers", "name": "finding", "x": X, "y": Y, "hovertext": H,
             "hoverinfo": "text", "marker": {"color": _RED, "size": 14, "symbol": "x-thin-open", "line": {"width": 3}}}]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _block_maps(m: _Model, limit: int) -> tuple[list[tuple[str, str, dict]], str]:
    """One figure per affected request: logical block index vs remote (P) block id."""
    bs_of: dict[str, list[int]] = {}
    for e in m.events:
        if e["ev"] == "sched.config":
            bs_of.setdefault(e.get("inst", "-"), list(e.get("block_sizes") or []))
    p_fin = {e["req"]: e for e in m.events if e["ev"] == "nixl.request_finished" and e.get("side") == "P" and "req" in e}
    pairing: dict[str, dict] = {}
    remote_alloc: dict[str, dict] = {}
    for e in m.events:
        if e["ev"] == "nixl.trim" and "req" in e:
            pairing[e["req"]] = e
        elif e["ev"] == "nixl.read" and "req" in e and e["req"] not in pairing:
            pairing[e["req"]] = e
        elif e["ev"] == "nixl.remote_alloc" and "req" in e:
            remote_alloc[e["req"]] = e

    block_reqs = {f.req for f in m.findings if f.kind == "lookahead-block-misalignment" and f.req}
    block_reqs |= {m.d2p[r] for r in block_reqs if r in m.d2p} | {m.p2d[r] for r in block_reqs if r in m.p2d}
    out: list[tuple[str, str, dict]] = []
    affected_total = 0
    ok_reqs: list[str] = []
    for dreq, pe in pairing.items():
        preq = m.d2p.get(dreq, dreq)
        fin = p_fin.get(preq)
        ra = remote_alloc.get(dreq)
        if pe["ev"] == "nixl.trim":
            local_in, remote_in = pe.get("local_in") or [], pe.get("remote_in") or []
            local_out, remote_out = pe.get("local_out") or [], pe.get("remote_out") or []
        else:
            local_out, remote_out = pe.get("local_block_ids") or [], pe.get("remote_block_ids") or []
            local_in = (ra or {}).get("local_block_ids") or local_out
            remote_in = (ra or {}).get("remote_block_ids") or remote_out
        reported = (fin or {}).get("block_ids") or remote_in
        ntok = (fin or {}).get("remote_num_tokens")
        if ntok is None:
            ntok = (ra or {}).get("remote_num_tokens")
        p_inst = (fin or {}).get("inst", "P")
        bsizes = bs_of.get(p_inst) or bs_of.get(pe.get("inst", "D")) or []
        traces: list[dict] = []
        mismatched = 0
        lookahead = 0
        tickvals: dict[int, str] = {}
        for g in range(max(len(local_out), len(reported))):
            rep = list(reported[g]) if g < len(reported) else []
            bs = bsizes[g] if g < len(bsizes) else None
            n_need = _ceil_div(ntok, bs) if (ntok is not None and bs) else len(rep)
            expected = rep[:n_need]
            li = list(local_in[g]) if g < len(local_in) else []
            lo = list(local_out[g]) if g < len(local_out) else []
            ro = list(remote_out[g]) if g < len(remote_out) else []
            # D keeps a local prefix-cache hit at the front: local_in is D's whole list for the request;
            # its logical index i pairs with P's logical block i (the first computed-token blocks).
            off = max(len(expected) - len(li), 0) if li else 0
            ex_x = list(range(len(expected)))
            gtag = f" g{g}" if len(reported) > 1 else ""
            traces.append({"type": "scatter", "mode": "markers", "name": f"expected P block{gtag} (covers computed tokens)",
                           "x": ex_x, "y": expected, "hoverinfo": "text",
                           "hovertext": [f"logical block {i}: P block {b} holds tokens {i * bs if bs else '?'}–"
                                         f"{(i + 1) * bs - 1 if bs else '?'}" for i, b in zip(ex_x, expected)],
                           "marker": {"size": 18, "symbol": "circle-open", "color": _GREEN, "line": {"width": 2}}})
            la = rep[n_need:]
            if la:
                lookahead += len(la)
                traces.append({"type": "scatter", "mode": "markers+text", "name": f"P lookahead block{gtag} (beyond computed tokens)",
                               "x": list(range(n_need, n_need + len(la))), "y": la, "text": ["lookahead"] * len(la),
                               "textposition": "top center", "hoverinfo": "text",
                               "hovertext": [f"P reported block {b} at logical index {n_need + k}, beyond the "
                                             f"{ntok} computed tokens (lookahead slot)" for k, b in enumerate(la)],
                               "marker": {"size": 14, "symbol": "square", "color": _ORANGE}})
            gx, gy, gh, gc, gs = [], [], [], [], []
            for j, (lb, rb) in enumerate(zip(lo, ro)):
                i = li.index(lb) + off if lb in li else j + (len(li) - len(lo)) + off
                tickvals.setdefault(i, f"{i}<br>D{lb}")
                exp = expected[i] if 0 <= i < len(expected) else None
                good = exp == rb
                mismatched += 0 if good else 1
                gx.append(i)
                gy.append(rb)
                gc.append(_GREEN if good else _RED)
                gs.append("circle" if good else "x")
                gh.append(f"D block {lb} (logical {i}) ← P block {rb}<br>expected P block {exp}"
                          + ("" if good else "<br><b>MISMATCH</b>" + (" (P lookahead block)" if rb in la else "")))
            if gx:
                traces.append({"type": "scatter", "mode": "markers", "name": f"actual pairing{gtag} (D {pe['ev']})",
                               "x": gx, "y": gy, "hovertext": gh, "hoverinfo": "text",
                               "marker": {"size": 11, "color": gc, "symbol": gs}})
                lx, ly = [], []
                for x, y in zip(gx, gy):
                    if 0 <= x < len(expected) and expected[x] != y:
                        lx += [x, x, None]
                        ly += [expected[x], y, None]
                if lx:
                    traces.append({"type": "scatter", "mode": "lines", "name": "shift (expected → actual)",
                                   "x": lx, "y": ly, "hoverinfo": "skip", "line": {"color": _RED, "dash": "dot"}})
        affected = mismatched > 0 or dreq in block_reqs or preq in block_reqs
        if not affected:
            ok_reqs.append(dreq)
            continue
        affected_total += 1
        if len(out) >= limit:
            continue
        title = (f"Block mapping: D {dreq} ← P {preq}: {mismatched} mismatched block(s), {lookahead} lookahead block(s) "
                 f"reported, remote_num_tokens {ntok}")
        n_x = max([len(r) for r in reported] + [max(tickvals) + 1 if tickvals else 0, 1])
        for i in range(n_x):
            tickvals.setdefault(i, str(i))
        tv = sorted(tickvals)
        layout = _layout(title, height=380, margin={"l": 70, "r": 20, "t": 40, "b": 60},
                         xaxis={"title": {"text": "logical block index (tick: D local block id)"}, "dtick": 1,
                                "range": [-0.5, n_x - 0.5],
                                "tickvals": tv or None, "ticktext": [tickvals[v] for v in tv] or None},
                         yaxis={"title": {"text": "remote (P) block id"}, "dtick": 1 if len(remote_in and remote_in[0]) < 30 else None})
        out.append((dreq, title, {"data": traces, "layout": layout}))
    note = f"{affected_total} affected request(s) of {len(pairing)} KV transfer(s)"
    if affected_total > limit:
        note += f"; the first {limit} are drawn, {affected_total - limit} more are listed in the findings table"
    if ok_reqs:
        note += f"; {len(ok_reqs)} transfer(s) pair every D block with the expected P block and are not drawn"
    return out, note


def _rows_owner(events: list[dict]) -> list[tuple[int, str, float, float | None, str]]:
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


def _accepted(m: _Model, budget: int, limit: int) -> tuple[list[tuple[str, dict]], str]:
    kinds = ("d2h.issue", "d2h.done", "acc.read", "acc.truth", "batch.add", "batch.remove", "batch.swap", "batch.condense")
    per: dict[str, list[dict]] = collections.defaultdict(list)
    for e in m.events:
        if e["ev"] in kinds:
            per[_lane(e)].append(e)
    stale_ids = {i for f in m.findings if f.kind == "stale-accepted-count-read" for i in f.event_ids}
    stale_steps = {(f.inst, f.step) for f in m.findings if f.kind == "stale-accepted-count-read"}
    figs: list[tuple[str, dict]] = []
    notes: list[str] = []
    for lane in sorted(per, key=_lane_key):
        evs = per[lane]
        if not any(e["ev"] == "acc.read" for e in evs):
            continue
        if len(figs) >= limit:
            notes.append(f"{lane} not drawn (limit {limit} workers)")
            continue
        total = len(evs)
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
            notes.append(f"{lane}: {len(evs)} of {total} accepted-count / batch events drawn ({why}); "
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
        for row, req, x0, x1, how in _rows_owner(xe):
            x1 = xmax + 0.05 if x1 is None else x1
            ob.append(x0)
            ox.append(max(x1 - x0, 1e-3))
            oy.append(row)
            oc.append(_color_of(req))
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
                           "marker": {"symbol": "triangle-right", "size": 10, "color": "#1f77b4"}})
        if cx:
            traces.append({"type": "scatter", "mode": "markers", "name": "copy completed", "x": cx, "y": cy,
                           "hovertext": ch, "hoverinfo": "text",
                           "marker": {"symbol": "triangle-left", "size": 10, "color": _GREEN}})
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
        style = {"ok": ("CPU read", "circle", _GREEN, 9), "early": ("CPU read before copy completed", "circle", _ORANGE, 11),
                 "stale": ("stale read (finding)", "x", _RED, 15)}
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
                           "marker": {"symbol": "diamond", "size": 11, "color": "#9467bd"}})
        rows_seen = sorted({y for tr in traces for y in tr.get("y", []) if isinstance(y, int)})
        layout = _layout(f"Accepted-token counts on {lane}: D2H copies, CPU reads, row owners",
                         height=max(300, 60 * len(rows_seen) + 160), barmode="overlay",
                         margin={"l": 70, "r": 20, "t": 40, "b": 45},
                         xaxis={"title": {"text": "time (ms since first event)"}},
                         yaxis={"title": {"text": "InputBatch row"}, "dtick": 1, "autorange": "reversed"})
        figs.append((lane, {"data": traces, "layout": layout}))
    return figs, "; ".join(notes)


_META_LANES = ["target forward", "drafter forward", "metadata bound", "save_kv_layer", "has_connector_metadata()",
               "clear_connector_metadata"]


def _metadata(m: _Model, max_steps: int, limit: int) -> tuple[list[tuple[str, dict]], str]:
    kinds = ("kvmeta.bind", "kvmeta.clear", "kvmeta.has", "kvmeta.save_layer", "kvmeta.wait_for_save", "spec.phase")
    per: dict[str, list[dict]] = collections.defaultdict(list)
    for e in m.events:
        if e["ev"] in kinds:
            per[_lane(e)].append(e)
    meta_find = {(f.inst, f.step) for f in m.findings if f.kind == "connector-metadata-cleared-before-drafter"}
    figs: list[tuple[str, dict]] = []
    notes: list[str] = []
    for lane in sorted(per, key=_lane_key):
        evs = per[lane]
        steps = sorted({e["step"] for e in evs if "step" in e})
        if len(figs) >= limit:
            notes.append(f"{lane} not drawn (limit {limit} workers)")
            continue
        if len(steps) > max_steps:
            bad = sorted({s for (i, s) in meta_find if i == evs[0].get("inst")} & set(steps))
            keep = set()
            for s in bad:
                keep.update(range(s - 2, s + 3))
            for s in steps:
                if len(keep) >= max_steps:
                    break
                keep.add(s)
            evs = [e for e in evs if e.get("step") in keep or "step" not in e]
            notes.append(f"{lane}: {len(keep & set(steps))} of {len(steps)} steps drawn "
                         f"({'steps around findings, then ' if bad else ''}the first steps)")
        traces: list[dict] = []
        bars: dict[str, list] = {n: [[], [], [], [], []] for n in _META_LANES[:3]}
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
                        P[3].append(_RED), P[4].append("x")
                elif e["phase"] in open_phase and name in bars:
                    x0, b = open_phase.pop(e["phase"])
                    B = bars[name]
                    B[0].append(x0), B[1].append(max(x - x0, 1e-3)), B[2].append(name)
                    B[3].append(f"<b>{name}</b> step {b.get('step')} {html.escape(str(b.get('method') or ''))}"
                                f"<br>{x0:.3f}–{x:.3f} ms; save_kv_layer calls: {save_count[e['phase']]}")
                    B[4].append("#6baed6" if e["phase"] == "target" else "#bcbddc")
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
                    B[4].append("#74c476")
                bound = None
                cleared_at = x
                during = [p for p in open_phase] or [""]
                P = pts["clear"]
                early = "drafter" not in open_phase and e.get("phase", "") != "drafter"
                P[0].append(x), P[1].append("clear_connector_metadata"), P[2].append(
                    f"<b>clear_connector_metadata</b> phase '{html.escape(e.get('phase', ''))}' step {e.get('step')}"
                    f"<br>open phases: {', '.join(during)}")
                P[3].append("#444"), P[4].append("line-ns-open" if early else "line-ns-open")
            elif k == "kvmeta.save_layer":
                save_count[e.get("phase", "")] += 1
                P = pts[f"save_kv_layer ({e.get('phase')})"]
                P[0].append(x), P[1].append("save_kv_layer"), P[2].append(
                    f"save_kv_layer {html.escape(str(e.get('layer')))} phase {e.get('phase')} step {e.get('step')}")
                P[3].append("#2171b5" if e.get("phase") == "target" else "#6a51a3"), P[4].append("circle")
            elif k == "kvmeta.has":
                key = "has_connector_metadata() = False" if not e.get("result") else "has_connector_metadata() = True"
                P = pts[key]
                P[0].append(x), P[1].append("has_connector_metadata()"), P[2].append(
                    f"has_connector_metadata() → {e.get('result')} phase {e.get('phase')} step {e.get('step')}")
                P[3].append(_RED if not e.get("result") else _GREEN), P[4].append("x" if not e.get("result") else "circle")
        for name, (b, w, y, h, c) in bars.items():
            if b:
                traces.append({"type": "bar", "orientation": "h", "base": b, "x": w, "y": y, "name": name,
                               "hovertext": h, "hoverinfo": "text", "marker": {"color": c}, "width": 0.6})
        for name, (x, y, h, c, s) in pts.items():
            traces.append({"type": "scatter", "mode": "markers", "name": name, "x": x, "y": y, "hovertext": h,
                           "hoverinfo": "text", "marker": {"color": c, "symbol": s, "size": 9 if "False" not in name else 12,
                                                           "line": {"width": 2, "color": c}}})
        ids = {e.get("id") for e in evs}
        traces.extend(_finding_markers(m, lambda e: "clear_connector_metadata" if e["ev"] == "kvmeta.clear" else (
            "has_connector_metadata()" if e["ev"] == "kvmeta.has" else (
                "drafter forward" if e["ev"] == "spec.phase" else None)), ids=ids))
        layout = _layout(f"Connector metadata and model phases per step on {lane}", height=360, barmode="overlay",
                         xaxis={"title": {"text": "time (ms since first event)"}},
                         yaxis={"type": "category", "categoryorder": "array", "categoryarray": _META_LANES[::-1],
                                "automargin": True})
        figs.append((lane, {"data": traces, "layout": layout}))
    return figs, "; ".join(notes)


def _windows(m: _Model, limit: int) -> tuple[dict | None, str]:
    """Drafter KV write windows vs the token slots the request's blocks cover."""
    bs_of: dict[str, list[int]] = {}
    for e in m.events:
        if e["ev"] == "sched.config":
            bs_of.setdefault(e.get("inst", "-"), list(e.get("block_sizes") or []))
    last_alloc: dict[tuple[str, str], dict] = {}
    local_blocks: dict[str, list] = {}
    rows = []
    win_ids = {i for f in m.findings if f.kind == "drafter-window-outside-allocation" for i in f.event_ids}
    win_reqs = {f.req for f in m.findings if f.kind == "drafter-window-outside-allocation"}
    n_windows = 0
    for e in m.events:
        k = e["ev"]
        if k == "sched.alloc" and "req" in e:
            last_alloc[(e.get("inst"), e["req"])] = e
        elif k == "nixl.remote_alloc" and "req" in e:
            local_blocks[e["req"]] = e.get("local_block_ids") or []
        elif k == "spec.window" and "req" in e:
            n_windows += 1
            g = e.get("group", 0) or 0
            a = last_alloc.get((e.get("inst"), e["req"]))
            blocks = (a or {}).get("block_ids") or local_blocks.get(e["req"]) or []
            bsz = bs_of.get(e.get("inst"), [])
            bs = bsz[g] if g < len(bsz) else None
            nb = len(blocks[g]) if g < len(blocks) else 0
            slots = nb * bs if bs else None
            outside = slots is not None and e["end"] > slots
            if outside or e.get("id") in win_ids or e["req"] in win_reqs:
                rows.append((e, slots, outside, nb, bs))
    if not rows:
        return None, (f"{n_windows} drafter write window(s) in the trace; none writes past the request's blocks"
                      if n_windows else "")
    shown = rows[:limit]
    traces = []
    ya, xa, ba, ha = [], [], [], []
    yw, xw, bw, hw, cw = [], [], [], [], []
    for e, slots, outside, nb, bs in shown:
        label = f"{e['req']} s{e.get('step')} ({e.get('inst')})"
        if slots is not None:
            ya.append(label), ba.append(0), xa.append(slots)
            ha.append(f"{nb} block(s) × {bs} = {slots} token slots owned")
        yw.append(label), bw.append(e["start"]), xw.append(max(e["end"] - e["start"], 0.1))
        cw.append(_RED if outside else _GREEN)
        hw.append(f"<b>drafter ({html.escape(str(e.get('method')))}) writes KV</b> positions {e['start']}–{e['end'] - 1}"
                  f"<br>owned slots: {slots}" + ("<br><b>writes past the allocation</b>" if outside else ""))
    traces.append({"type": "bar", "orientation": "h", "base": ba, "x": xa, "y": ya, "name": "token slots owned",
                   "hovertext": ha, "hoverinfo": "text", "marker": {"color": "#c7e9c0"}, "width": 0.8})
    traces.append({"type": "bar", "orientation": "h", "base": bw, "x": xw, "y": yw, "name": "drafter write window",
                   "hovertext": hw, "hoverinfo": "text", "marker": {"color": cw}, "width": 0.4})
    layout = _layout("Drafter KV write windows vs owned token slots", barmode="overlay",
                     height=max(260, 40 * len(shown) + 140),
                     xaxis={"title": {"text": "token position"}}, yaxis={"type": "category", "automargin": True})
    note = f"{len(rows)} window(s) outside the allocation or cited by a finding"
    if len(rows) > limit:
        note += f"; first {limit} drawn"
    return {"data": traces, "layout": layout}, note


# --------------------------------------------------------------------------------------
# page
# --------------------------------------------------------------------------------------

def _esc(x: Any) -> str:
    return html.escape(str(x))


def _summary_html(header: dict, footer: dict | None, problems: Sequence[Any], events: list[dict],
                  findings: list[FindingView], findings_note: str) -> str:
    counts = (footer or {}).get("counts") or collections.Counter(e["ev"] for e in events)
    insts = sorted({e.get("inst", "-") for e in events})
    v = header.get("versions") or {}
    rows = [("origin", header.get("origin")), ("created", header.get("created")), ("host", header.get("host")),
            ("redacted", header.get("redacted")), ("command", " ".join(map(str, header.get("cmd") or []))),
            ("versions", ", ".join(f"{k} {val or '—'}" for k, val in v.items())),
            ("instances", ", ".join(insts)), ("events", f"{len(events):,}"),
            ("complete", "yes" if footer is not None and not problems else "NO (damaged or cut trace: read with --lenient)")]
    if footer:
        rows.append(("dropped events", footer.get("dropped", 0)))
        he = footer.get("hook_errors") or {}
        rows.append(("hook errors", ", ".join(f"{k}: {n}" for k, n in he.items()) or "none"))
        sk = (footer.get("hooks") or {}).get("skipped") or {}
        if sk:
            rows.append(("hooks skipped", "; ".join(f"{k}: {r}" for k, r in sk.items())))
    out = ['<section id="summary"><h2>Trace</h2><table class="kv">']
    out += [f"<tr><th>{_esc(k)}</th><td>{_esc(val)}</td></tr>" for k, val in rows]
    out.append("</table>")
    if problems:
        out.append(f'<p class="warn">{len(problems)} problem line(s) skipped: '
                   + _esc("; ".join(str(p) for p in list(problems)[:5])) + "</p>")
    out.append('<details><summary>events per kind</summary><table class="counts">'
               + "".join(f"<tr><td>{_esc(k)}</td><td>{n:,}</td></tr>" for k, n in sorted(counts.items()))
               + "</table></details></section>")
    out.append('<section id="findings"><h2>Findings</h2>')
    if findings_note:
        out.append(f'<p class="note">{_esc(findings_note)}</p>')
    cov_table, unchecked = coverage_html(events, header, footer)
    if not findings:
        out.append(no_findings_line(unchecked))
    else:
        n_err = sum(f.severity == "error" for f in findings)
        out.append(f"<p>{len(findings)} finding(s): {n_err} error(s), {len(findings) - n_err} warning(s).</p>")
        out.append('<table class="findings"><tr><th>severity</th><th>kind</th><th>instance</th><th>step</th>'
                   "<th>request</th><th>finding</th><th>events</th></tr>")
        for f in findings:
            ids = ", ".join(f"#{i}" for i in f.event_ids[:12]) + (" …" if len(f.event_ids) > 12 else "")
            out.append(f'<tr class="{_esc(f.severity)}"><td><span class="sev {_esc(f.severity)}">{_esc(f.severity)}</span></td>'
                       f"<td>{_esc(f.kind)}</td><td>{_esc(f.inst or '')}</td><td>{_esc('' if f.step is None else f.step)}</td>"
                       f"<td>{_esc(f.req or '')}</td><td><b>{_esc(f.title)}</b><br><span class='expl'>{_esc(f.explanation)}</span>"
                       + (f"<details><summary>data</summary><pre>{_esc(_short(f.data, 2000))}</pre></details>" if f.data else "")
                       + f"</td><td>{_esc(ids)}</td></tr>")
        out.append("</table>")
    out.append(cov_table)
    out.append("</section>")
    return "\n".join(out)


def render(trace: Any, findings: Iterable[Any] | None = None, *, findings_note: str = "",
           max_bytes: int = MAX_BYTES, point_budget: int = DEFAULT_POINT_BUDGET) -> tuple[str, dict[str, Any]]:
    """Render the report page for a loaded ``pdtrace.trace.Trace``. Returns (html, stats)."""
    fv = [FindingView.of(f) for f in (findings or [])]
    budget = point_budget
    js = _packed_plotly()
    while True:
        page, stats = _render_once(trace, fv, findings_note, budget, js)
        stats["bytes"] = len(page.encode())
        stats["point_budget"] = budget
        if stats["bytes"] <= max_bytes or budget <= 200:
            return page, stats
        budget = max(200, int(budget * max_bytes / stats["bytes"] * 0.8))


def _figure_section(sec_id: str, heading: str, intro: str, note: str, empty: str, figs: list[Any],
                    fig_div: Callable[[str, Any], str]) -> str:
    """<section> with an intro note (plus the decimation note, if any), the figures, or a line
    saying there is nothing of this kind in the trace."""
    body = ['<p class="note">' + intro + (f" <b>{_esc(note)}.</b>" if note else "") + "</p>"]
    if not figs:
        body.append(f'<p class="ok">{empty}</p>')
    for i, fig in enumerate(figs):
        body.append(fig_div(f"fig-{sec_id}-{i}", fig))
    return f'<section id="{sec_id}"><h2>{heading}</h2>' + "".join(body) + "</section>"


def _render_once(trace: Any, fv: list[FindingView], findings_note: str, budget: int, js: str) -> tuple[str, dict]:
    events = trace.events
    m = _Model(events, fv)
    sections: list[str] = []
    figs: dict[str, dict] = {}

    def fig_div(fid: str, fig: dict) -> str:
        figs[fid] = fig
        h = int(fig["layout"].get("height", 400))
        return f'<div id="{fid}" class="pdfig" style="min-height:{h}px"></div>'

    tl, st = _timeline(m, budget, bins=max(50, min(400, budget // 40)))
    agg = []
    if st["aggregated"]:
        agg.append(f"{st['drawn']:,} of {st['events']:,} events are drawn one by one (those near a finding); the other "
                   f"{st['aggregated']:,} events are aggregated into {st['bins']:,} time bins per lane (grey markers, "
                   f"size = count, hover for the kinds)")
    else:
        agg.append(f"all {st['events']:,} events are drawn one by one")
    if st.get("aggregated_steps"):
        agg.append(f"{st['aggregated_steps']:,} engine steps far from findings are not drawn as bars")
    if st.get("kv_not_drawn"):
        agg.append(f"{st['kv_not_drawn']:,} KV transfers without findings are not drawn")
    sections.append('<section id="timeline"><h2>Timeline</h2><p class="note">Lanes are instance / process role / '
                    "rank. Blue bars: engine steps (hover: tokens per request). Lines: KV transfers from P's "
                    "request_finished to D's NIXL read and its completion. Red ×: events a finding cites. "
                    f"<b>{_esc('; '.join(agg))}.</b></p>" + fig_div("fig-timeline", tl) + "</section>")

    maps, note = _block_maps(m, limit=12)
    body = [f'<p class="note">x: logical block index of the request (tick label: D local block id); y: P block id. '
            f"Green rings: the P block expected for that position (blocks covering the computed tokens); orange "
            f"squares: lookahead blocks P reported beyond them; dots: the pairing D used (green = expected, red × = "
            f"mismatch). {_esc(note)}.</p>"]
    for i, (req, _title, fig) in enumerate(maps):
        body.append(f'<h3 id="req-{_esc(req)}">{_esc(req)}</h3>' + fig_div(f"fig-blockmap-{i}", fig))
    sections.append('<section id="blockmaps"><h2>Block mapping per affected request</h2>' + "".join(body) + "</section>")

    acc, note = _accepted(m, budget=max(500, budget // 4), limit=4)
    sections.append(_figure_section(
        "accepted", "Accepted-token counts",
        "y: InputBatch row. Shaded bars: the request owning the row over time (from batch.add / "
        "swap_states / condense). ▶ D2H copy of num_accepted_tokens issued, ◀ its CUDA event observed complete, "
        "● CPU read (orange: read before the copy completed, red ×: stale read cited by a finding).",
        note, "No accepted-count reads in this trace.", [fig for _lane, fig in acc], fig_div))

    meta, note = _metadata(m, max_steps=max(20, budget // 600), limit=4)
    sections.append(_figure_section(
        "metadata", "Connector metadata phases",
        "Per worker: target / drafter forward phases, the span during which connector metadata "
        "is bound (bind → clear), save_kv_layer calls and has_connector_metadata() answers. A drafter forward with "
        "no metadata bound cannot save its KV.",
        note, "No connector-metadata events in this trace.", [fig for _lane, fig in meta], fig_div))

    win, note = _windows(m, limit=40)
    if win is not None or note:
        sections.append('<section id="windows"><h2>Drafter KV write windows</h2>'
                        + (f'<p class="note">{_esc(note)}.</p>' if note else "")
                        + (fig_div("fig-windows", win) if win is not None else "") + "</section>")

    summary = _summary_html(trace.header, trace.footer, trace.problems, events, fv, findings_note)
    title = f"pdtrace report: {os.path.basename(str(getattr(trace, 'path', '') or 'trace'))}"
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (
        ("summary", "Trace"), ("findings", "Findings"), ("timeline", "Timeline"), ("blockmaps", "Block maps"),
        ("accepted", "Accepted counts"), ("metadata", "Connector metadata")))
    tpl = _TEMPLATE.read_text()
    parts = {"TITLE": _esc(title), "NAV": nav, "SUMMARY": summary, "SECTIONS": "\n".join(sections),
             "PLOTLY": js, "DATA": _pack({"figs": figs})}
    page = re.sub(r"\{\{([A-Z]+)\}\}", lambda mo: parts[mo.group(1)], tpl)  # one pass: data never re-expanded
    stats = dict(st)
    stats["figures"] = len(figs)
    stats["figure_ids"] = sorted(figs)
    return page, stats


def write(trace: Any, path: str | os.PathLike, findings: Iterable[Any] | None = None, **kw: Any) -> dict[str, Any]:
    page, stats = render(trace, findings, **kw)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, path)
    return stats
