"""What every part of the HTML report shares: the colours (and the words captions use for
them), small formatting helpers, the finding view, and ``Model``, the indexed trace the
figures, the summary and the event table are drawn from.

Captions never spell a colour by hand: ``swatch(colour)`` writes a little square in that
colour plus its word from ``COLOR_WORDS``, from the same constant the figure's trace uses.
"""

from __future__ import annotations

import bisect
import dataclasses
import html
from typing import Any, Iterable

import orjson

# ------------------------------------------------------------------------------ colours
RED = "#d62728"
ORANGE = "#ff7f0e"
GREEN = "#2ca02c"
BLUE = "#1f77b4"
PURPLE = "#9467bd"
BROWN = "#8c564b"
CYAN = "#17becf"
GREY = "#7f7f7f"
LIGHT_GREY = "#bbbbbb"
DARK_GREY = "#444444"
STEP_BAR = ("#9ecae1", "#c6dbef")  # engine steps, alternating
STEP_BAR_FINDING = "#f4a6a6"  # an engine step a finding names
OWNED_SLOTS = "#c7e9c0"
TARGET_FWD = "#6baed6"
DRAFTER_FWD = "#bcbddc"
META_BOUND = "#74c476"
SAVE_TARGET = "#2171b5"
SAVE_DRAFTER = "#6a51a3"

COLOR_WORDS = {
    RED: "red", ORANGE: "orange", GREEN: "green", BLUE: "blue", PURPLE: "purple", BROWN: "brown",
    CYAN: "cyan", GREY: "grey", LIGHT_GREY: "light grey", DARK_GREY: "dark grey",
    STEP_BAR[0]: "light blue", STEP_BAR[1]: "light blue", STEP_BAR_FINDING: "pink", OWNED_SLOTS: "pale green",
    TARGET_FWD: "blue", DRAFTER_FWD: "lavender", META_BOUND: "green", SAVE_TARGET: "dark blue",
    SAVE_DRAFTER: "dark purple",
}

CATEGORY = {  # event kind prefix -> (legend name, colour)
    "sched": ("scheduler", BLUE),
    "req": ("scheduler", BLUE),
    "nixl": ("NIXL connector", GREEN),
    "kvmeta": ("connector metadata", PURPLE),
    "spec": ("spec decode", BROWN),
    "d2h": ("accepted counts", ORANGE),
    "acc": ("accepted counts", ORANGE),
    "batch": ("input batch", CYAN),
    "kvload": ("KV load failure", RED),
}
OTHER = ("process / marks", GREY)
PALETTE = [BLUE, GREEN, PURPLE, BROWN, "#e377c2", CYAN, "#bcbd22", GREY,
           "#aec7e8", "#98df8a", "#c5b0d5", "#c49c94"]


def color_word(color: str) -> str:
    return COLOR_WORDS[color]


def swatch(color: str, word: str | None = None, trace: str | None = None) -> str:
    """A square in ``color`` and its name: what a caption says instead of a hand-written colour
    (``trace``: the legend name of the trace it stands for, kept as data-trace for tests)."""
    tr = f' data-trace="{html.escape(trace)}"' if trace else ""
    return (f'<span class="sw" data-color="{color}"{tr} style="background:{color}"></span>'
            f'<span class="swname">{html.escape(word or color_word(color))}</span>')


def trace_colours(t: dict[str, Any]) -> set[str]:
    """Every colour a plotly trace draws with (marker, marker outline, line)."""
    out: set[str] = set()
    mk = t.get("marker") or {}
    for c in (mk.get("color"), (mk.get("line") or {}).get("color"), (t.get("line") or {}).get("color")):
        if isinstance(c, str):
            out.add(c)
        elif isinstance(c, list):
            out.update(x for x in c if isinstance(x, str))
    return out


LegendItem = tuple[str, "str | tuple[str, ...]", str]  # (trace name prefix, colour(s), text)


def legend(figs: Iterable[dict], items: Iterable[LegendItem], sep: str = "; ") -> str:
    """Caption phrases for the traces actually drawn: an item is kept only when a trace whose
    name starts with its prefix draws with its colour (the first of several that is drawn),
    and its swatch shows that colour."""
    traces = [t for f in figs if f for t in f["data"]]
    out = []
    for prefix, colours, text in items:
        for c in ((colours,) if isinstance(colours, str) else colours):
            if any(str(t.get("name", "")).startswith(prefix) and c in trace_colours(t) for t in traces):
                out.append(f"{swatch(c, trace=prefix)} {text}")
                break
    return sep.join(out)


# ------------------------------------------------------------------------------ helpers
def esc(x: Any) -> str:
    return html.escape(str(x))


def cat(kind: str) -> tuple[str, str]:
    return CATEGORY.get(kind.split(".", 1)[0], OTHER)


def short(obj: Any, limit: int = 400) -> str:
    s = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()
    return s if len(s) <= limit else s[: limit - 1] + "…"


BASE_FIELDS = ("ev", "t", "w", "pid", "role", "inst", "rank", "step", "req", "id")


def rest_fields(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in BASE_FIELDS}


def hover(e: dict[str, Any]) -> str:
    parts = [f"<b>{html.escape(e['ev'])}</b> #{e.get('id')}",
             f"{e.get('inst')} {e.get('role')}" + (f" rank {e['rank']}" if "rank" in e else "") + f" pid {e.get('pid')}"]
    if "step" in e:
        parts.append(f"step {e['step']}")
    if "req" in e:
        parts.append(f"req {html.escape(str(e['req']))}")
    rest = rest_fields(e)
    if rest:
        body = html.escape(short(rest, 360))
        parts.append("<br>".join(body[i:i + 90] for i in range(0, len(body), 90)))
    return "<br>".join(parts)


def lane(e: dict[str, Any]) -> str:
    role = e.get("role", "?")
    if "rank" in e:
        return f"{e.get('inst', '-')} {role} r{e['rank']}"
    return f"{e.get('inst', '-')} {role}"


def lane_key(name: str) -> tuple:
    inst = name.split(" ", 1)[0]
    return ({"P": 0, "PD": 1, "D": 2}.get(inst, 3), name)


def color_of(name: str) -> str:
    h = 0
    for ch in str(name):
        h = (h * 131 + ord(ch)) & 0xFFFFFFFF
    return PALETTE[h % len(PALETTE)]


def fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def layout(title: str, **kw: Any) -> dict[str, Any]:
    lay = {"title": {"text": title, "font": {"size": 15}}, "hovermode": "closest", "template": None,
           "margin": {"l": 150, "r": 20, "t": 40, "b": 45}, "legend": {"orientation": "v", "x": 1.01, "y": 1},
           "plot_bgcolor": "#fafafa", "paper_bgcolor": "#ffffff", "font": {"family": "sans-serif", "size": 12}}
    lay.update(kw)
    return lay


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


# ------------------------------------------------------------------------------ the model
class Model:
    """The trace indexed once for every figure: time axis (ms since the first event),
    findings, the P<->D request pairing and the requests / steps findings touch."""

    def __init__(self, events: list[dict[str, Any]], findings: list[FindingView], totals: Any = None):
        """``totals``: a trace too big to hold (``reduce.Totals``): ``events`` are the ones
        kept for the page, and the time axis, the P/D pairs and every count are the trace's."""
        self.events = events
        self.findings = findings
        self.totals = totals
        self.by_id = {e.get("id", i): e for i, e in enumerate(events)}
        if totals is not None:
            self.tkey, self.t0 = "w", totals.t_lo
        else:
            self.tkey = "w" if all("w" in e for e in events[:1000]) else "t"
            self.t0 = min((e[self.tkey] for e in events), default=0)
        self.finding_reqs = {f.req for f in findings if f.req}
        self.finding_ids = sorted({i for f in findings for i in f.event_ids})
        self.finding_steps = {(f.inst, f.step) for f in findings if f.step is not None}
        self.d2p: dict[str, str] = {}  # D request -> P request (remote_request_id)
        for e in (events if totals is None else ()):
            k = e["ev"]
            if k == "req.add" and isinstance(e.get("kv"), dict) and e["kv"].get("remote_request_id") and "req" in e:
                self.d2p[e["req"]] = str(e["kv"]["remote_request_id"])
            elif k in ("nixl.remote_alloc", "nixl.read") and e.get("remote_req") and "req" in e:
                self.d2p.setdefault(e["req"], str(e["remote_req"]))
        if totals is not None:
            self.d2p = totals.d2p
        self.p2d = {p: d for d, p in self.d2p.items()}
        self.affected_reqs = set(self.finding_reqs)
        for r in list(self.finding_reqs):
            if r in self.d2p:
                self.affected_reqs.add(self.d2p[r])
            if r in self.p2d:
                self.affected_reqs.add(self.p2d[r])

    def x(self, e: dict[str, Any]) -> float:
        return (e[self.tkey] - self.t0) / 1e6  # ms

    def x_end(self) -> float:
        if self.totals is not None:
            return (self.totals.t_hi - self.t0) / 1e6
        return max((self.x(e) for e in self.events), default=0.0)

    @property
    def n_events(self) -> int:
        """Events in the trace (``events`` may be only those kept for the page)."""
        return self.totals.n if self.totals is not None else len(self.events)

    def near_finding(self, e: dict[str, Any], radius: int = 64) -> bool:
        if e.get("req") in self.affected_reqs:
            return True
        if (e.get("inst"), e.get("step")) in self.finding_steps:
            return True
        ids = self.finding_ids
        if not ids:
            return False
        i = e.get("id", -1)
        j = bisect.bisect_left(ids, i)
        return (j < len(ids) and ids[j] - i <= radius) or (j > 0 and i - ids[j - 1] <= radius)

    def finding_span(self, f: FindingView) -> tuple[float, float] | None:
        """(first, last) time (ms) of the events a finding cites."""
        xs = [self.x(self.by_id[i]) for i in f.event_ids if i in self.by_id]
        return (round(min(xs), 6), round(max(xs), 6)) if xs else None

    def finding_range(self, f: FindingView) -> tuple[float, float] | None:
        """The time range (ms) a finding is about: from its first to its last cited event,
        padded (15 %, at least 0.05 ms each side, never more than 0.05 ms before the first
        event of the trace) so that the edges stay visible."""
        span = self.finding_span(f)
        if span is None:
            return None
        lo, hi = span
        pad = max((hi - lo) * 0.15, 0.05)
        return (round(max(lo - pad, min(lo, 0.0) - 0.05), 6), round(hi + pad, 6))

    def findings_range(self) -> tuple[float, float] | None:
        rs = [r for r in (self.finding_range(f) for f in self.findings) if r]
        if not rs:
            return None
        return (min(r[0] for r in rs), max(r[1] for r in rs))


def finding_markers(m: Model, yof, only: Iterable[str] | None = None, ids: set | None = None) -> list[dict]:
    """Red crosses on the events findings cite (at most 20 per finding), y from ``yof(event)``;
    ``customdata`` holds each cross's event id."""
    X, Y, H, C = [], [], [], []
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
            C.append(i)  # the page script marks the selected finding's crosses by event id
            H.append(f"<b>{html.escape(f.severity)}: {html.escape(f.title)}</b><br>{html.escape(f.kind)}"
                     f"<br>event #{i} {html.escape(e['ev'])}")
    if not X:
        return []
    return [{"type": "scatter", "mode": "markers", "name": "finding", "x": X, "y": Y, "hovertext": H, "customdata": C,
             "hoverinfo": "text", "marker": {"color": RED, "size": 14, "symbol": "x-thin-open", "line": {"width": 3}}}]
