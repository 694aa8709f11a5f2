"""The findings list and the request list (left column)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import OptionList
from textual.widgets.option_list import Option

MAX_REQUESTS_SHOWN = 5000


def finding_label(f: Any) -> Text:
    t = Text()
    sev = getattr(f, "severity", "error")
    t.append("● " if sev == "error" else "▲ ", style="bold red" if sev == "error" else "bold yellow")
    t.append(f"{f.kind}", style="bold")
    where = []
    if f.req:
        where.append(f"req {f.req}")
    if f.step is not None:
        where.append(f"step {f.step}")
    if f.inst:
        where.append(str(f.inst))
    if where:
        t.append("  " + " ".join(where), style="cyan")
    t.append("\n  " + f.title)
    return t


class FindingsList(OptionList):
    DEFAULT_CSS = """
    FindingsList { height: 1fr; min-height: 4; border: round $error 60%; }
    FindingsList:focus { border: round $error; }
    """

    def show(self, findings: list[Any], note: str = "") -> None:
        self.clear_options()
        if note:
            self.add_option(Option(Text(note, style="dim"), id="note", disabled=True))
        for k, f in enumerate(findings):
            self.add_option(Option(finding_label(f), id=f"f{k}"))
        self.border_title = f"Findings ({len(findings)})"


class RequestList(OptionList):
    DEFAULT_CSS = """
    RequestList { height: 2fr; border: round $primary 60%; }
    RequestList:focus { border: round $primary; }
    """

    def show(self, rows: list[tuple[str, str, bool]], total: int, flt: str) -> None:
        """rows: (request id, instances, has finding)."""
        keep = self.highlighted_option.id if self.highlighted_option is not None else None
        self.clear_options()
        opts = []
        for req, insts, bad in rows[:MAX_REQUESTS_SHOWN]:
            t = Text()
            t.append("● " if bad else "  ", style="bold red")
            t.append(req, style="bold red" if bad else "")
            t.append(f"  {insts}", style="dim")
            opts.append(Option(t, id=f"r:{req}"))
        self.add_options(opts)
        if keep is not None:
            try:
                self.highlighted = self.get_option_index(keep)
            except Exception:
                pass
        shown = min(len(rows), MAX_REQUESTS_SHOWN)
        self.border_title = f"Requests ({shown}/{total})" + (f" filter: {flt}" if flt else "")
