"""The findings list and the request list (left column).

Findings take one line each (kind names are never broken: a line is cut with an
ellipsis, the full text is in the panes), grouped by bug class -- every class gets a
header with its coverage verdict, so a class that was "not checked" says why -- or by
request. Requests are listed P then its D partner(s), indented under it.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

from rich.text import Text
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from pdtrace.detectors.crossed import short_line

MAX_REQUESTS_SHOWN = 5000
CROSSED = "kv-never-crossed"  # its facts (where D's prompt tokens came from) go under its header
SHORT = {
    "lookahead-block-misalignment": "lookahead",
    "drafter-window-outside-allocation": "drafter window",
    "connector-metadata-cleared-before-drafter": "metadata cleared",
    "stale-accepted-count-read": "stale acc read",
    "kv-load-failure-recovery": "kv load failure",
    "kv-never-crossed": "kv never crossed",
}
_PREFIX = re.compile(r"^(?:request \S+?)?(?:\s*step \d+)?:\s+")


def short_title(f: Any) -> str:
    """The title without the 'request R step S:' the line already shows."""
    return _PREFIX.sub("", f.title, count=1) if _PREFIX.match(f.title) else f.title


MARKS = {"error": ("● ", "bold red"), "warning": ("▲ ", "bold yellow"), "inconclusive": ("? ", "bold magenta")}


def short_req(req: str, n: int = 22) -> str:
    """A long request id (vLLM's cmpl-<16 hex>-0-<8 hex>) cut in the middle, its ends kept: the
    list's step and title stay in sight (the filter and the panes take the whole id)."""
    return req if len(req) <= n else req[: n // 2] + "…" + req[-(n - n // 2 - 1):]


def finding_line(f: Any, by: str) -> Text:
    """mark (● error, ▲ warning, ? inconclusive: told apart without colour), step, instance,
    request, title: the step first, so a narrow list never cuts it."""
    t = Text(no_wrap=True, overflow="ellipsis")
    sev = getattr(f, "severity", "error")
    mark, style = MARKS.get(sev, MARKS["warning"])
    t.append(mark, style=style)
    if f.step is not None:
        t.append(f"s{f.step} ", style="cyan")
    if f.inst:
        t.append(f"{f.inst} ", style="dim cyan")
    if by == "request":
        t.append(SHORT.get(f.kind, f.kind) + " ", style="bold")
    elif f.req:
        t.append(f"{short_req(f.req)} ", style="cyan")
    t.append(short_title(f))
    return t


def matches(f: Any, flt: str) -> bool:
    flt = flt.lower()
    return not flt or any(flt in str(x).lower() for x in (f.kind, f.req or "", f.title, f.inst or "",
                                                          SHORT.get(f.kind, "")))


def _cov_text(c: Any) -> tuple[str, str]:
    line = c.line()
    if c.status == "not-checked":
        return "? " + line, "yellow"
    if c.status == "not-applicable":
        return "– " + line, "dim"
    return "✓ " + line + ": clean", "green"



def select_option(ol: Any, option_id: str) -> None:
    """Highlight the option with this id, if the list (still) has it."""
    try:
        ol.highlighted = ol.get_option_index(option_id)
    except Exception:  # noqa: BLE001 - an id filtered out or not built yet: leave the highlight
        pass

class FindingsList(OptionList):
    DEFAULT_CSS = """
    FindingsList { height: 1fr; min-height: 4; border: round $error 60%; text-wrap: nowrap; text-overflow: ellipsis; }
    FindingsList:focus { border: round $error; }
    """

    _args: tuple[Any, ...] | None = None

    def on_resize(self) -> None:
        if self._args is not None:
            self.show(*self._args[0], **self._args[1])

    def _wrap(self, text: str, indent: int) -> str:
        """Coverage reasons are wrapped here (the list itself cuts lines with an ellipsis)."""
        width = max(20, (self.scrollable_content_region.width or 34) - 3)  # (the scrollbar takes 2)
        lines = textwrap.wrap(text, width, subsequent_indent=" " * indent, break_on_hyphens=False)
        if len(lines) > 3:  # the whole reason is in `pdtrace check` and on the verdict line
            lines = lines[:2] + [lines[2][:width - 1] + "…"]
        return "\n".join(lines)

    def show(self, findings: list[Any], note: str = "", *, by: str = "class", flt: str = "",
             coverage: dict[str, Any] | None = None, notes: dict[str, list] | None = None) -> None:
        self._args = ((findings, note), dict(by=by, flt=flt, coverage=coverage, notes=notes))
        keep = self.highlighted_option.id if self.highlighted_option is not None else None
        self.clear_options()
        opts: list[Option] = []
        if note:
            opts.append(Option(Text(note, style="dim"), id="note", disabled=True))
        shown = [(k, f) for k, f in enumerate(findings) if matches(f, flt)]
        if by == "request":
            groups: dict[str, list] = {}
            for k, f in shown:
                groups.setdefault(f.req or "(no request)", []).append((k, f))
            for g, items in groups.items():
                opts.append(Option(Text(f"{g}  ({len(items)})", style="bold cyan", no_wrap=True,
                                        overflow="ellipsis"), id=f"h:{g}", disabled=True))
                opts.extend(Option(finding_line(f, by), id=f"f{k}") for k, f in items)
        else:
            # classes with findings first, then the others with their coverage verdict
            kinds = [f.kind for _, f in shown] + list(coverage or {})
            for kind in dict.fromkeys(kinds):
                items = [(k, f) for k, f in shown if f.kind == kind]
                head = Text(no_wrap=True, overflow="ellipsis")
                head.append(kind, style="bold red" if items else "bold")
                if items:
                    head.append(f"  {len(items)}", style="red")
                opts.append(Option(head, id=f"h:{kind}", disabled=True))
                c = (coverage or {}).get(kind)
                if c is not None and (not items or c.status != "checked"):
                    text, style = _cov_text(c)
                    opts.append(Option(Text(self._wrap("  " + text, 4), style=style), id=f"c:{kind}", disabled=True))
                facts = ((notes or {}).get(kind) or []) if kind == CROSSED else []
                for i, n in enumerate(facts):
                    opts.append(Option(Text(self._wrap("  " + short_line(n), 4), style="dim"), id=f"n:{kind}:{i}",
                                       disabled=True))
                opts.extend(Option(finding_line(f, by), id=f"f{k}") for k, f in items)
        self.add_options(opts)
        if keep is not None:
            select_option(self, keep)
        n = f"{len(shown)}/{len(findings)}" if flt else str(len(findings))
        self.border_title = f"Findings ({n})" + (f" filter: {flt}" if flt else "")
        self.border_subtitle = f"g: by {'class' if by == 'request' else 'request'}"


class RequestList(OptionList):
    DEFAULT_CSS = """
    RequestList { height: 1fr; border: round $primary 60%; text-wrap: nowrap; text-overflow: ellipsis; }
    RequestList:focus { border: round $primary; }
    """

    def show(self, rows: list[tuple[str, str, bool, int]], total: int, flt: str) -> None:
        """rows: (request id, instances, has finding, depth); depth 1 = the D partner of the row above."""
        keep = self.highlighted_option.id if self.highlighted_option is not None else None
        self.clear_options()
        opts = []
        for req, insts, bad, depth in rows[:MAX_REQUESTS_SHOWN]:
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append("● " if bad else "  ", style="bold red")
            if depth:
                t.append("└ ", style="dim")
            t.append(req, style="bold red" if bad else "")
            t.append(f"  {insts}", style="dim")
            opts.append(Option(t, id=f"r:{req}"))
        self.add_options(opts)
        if keep is not None:
            select_option(self, keep)
        shown = min(len(rows), MAX_REQUESTS_SHOWN)
        self.border_title = f"Requests ({shown}/{total})" + (f" filter: {flt}" if flt else "")
