"""The pane base class and the text helpers every pane uses.

A pane keeps the arguments of its last ``show`` and renders them for its current width
(again on every resize): prose (verdicts, reasons, explanations) is wrapped to the width;
tables keep their columns and the pane scrolls sideways where one is wider than the screen.
"""

from __future__ import annotations

import textwrap
from typing import Any, Iterable

from rich.text import Text
from textual.containers import ScrollableContainer
from textual.widgets import Static

BAD = "bold white on red"
OK = "green"


class Pane(ScrollableContainer):
    DEFAULT_CSS = """
    Pane { height: 1fr; padding: 0 1; overflow-x: auto; overflow-y: auto; }
    Pane > Static { width: auto; }
    """

    _shown: Text | None = None
    _args: tuple[Any, ...] | None = None
    verdict_above = False  # the app shows the selected finding above the tabs: do not repeat it

    def head(self, t: Text, findings: Iterable[Any], width: int, selected: Any = None) -> None:
        finding_header(t, findings, width, selected, skip_main=self.verdict_above)

    def set_verdict_above(self, on: bool) -> None:
        if on != self.verdict_above:
            self.verdict_above = on
            self._draw()

    def compose(self):
        yield Static(id=f"{self.id}-body", classes="pane-body")

    def show(self, *args: Any) -> None:
        self._args = args
        self._draw()

    def build(self, width: int, *args: Any) -> Text:  # pragma: no cover - every pane overrides it
        raise NotImplementedError

    def _draw(self) -> None:
        if self._args is None or not self.is_mounted:
            return
        self.set_text(self.build(self.text_width, *self._args))

    def on_resize(self) -> None:
        self._draw()

    @property
    def text_width(self) -> int:
        """Columns prose may use: the pane less its padding and a vertical scrollbar."""
        w = self.size.width or (self.app.size.width if self.is_attached else 80)
        return max(24, w - 3)

    def set_text(self, text: Text) -> None:
        self._shown = text
        self.query_one(Static).update(text)

    @property
    def text(self) -> str:
        """Plain text of what is shown (tests)."""
        return self._shown.plain if self._shown is not None else ""

    @property
    def shown(self) -> Text | None:
        return self._shown


def para(t: Text, text: str, width: int, style: str = "", indent: int = 0, first: str = "") -> None:
    """Append ``text`` wrapped to ``width`` columns (``first`` prefixes the first line, the
    rest are indented by ``indent``), never breaking a word unless it alone is too long."""
    lines = textwrap.wrap(text, width=max(10, width), initial_indent=first or " " * indent,
                          subsequent_indent=" " * indent, break_on_hyphens=False) or [first]
    for line in lines:
        t.append(line + "\n", style=style)


def _chosen(findings: list[Any], selected: Any) -> Any:
    return selected if selected in findings else (findings[0] if findings else None)


def finding_header(t: Text, findings: Iterable[Any], width: int, selected: Any = None, others: int = 3,
                   skip_main: bool = False) -> None:
    """The verdicts on top of a pane: the selected finding's (else the first's) kind and title
    wrapped, then up to ``others`` more on one line each. The explanation goes below the
    pane's picture (``finding_footer``), so the verdict and the red cells come first."""
    findings = list(findings)
    if not findings:
        return
    main = _chosen(findings, selected)
    rest = [f for f in findings if f is not main]
    if skip_main and main is selected:
        if rest:
            t.append(f"+{len(rest)} other finding(s) here (f / F)\n\n", style="red")
        return
    t.append(f" {main.kind} ", style=BAD)
    t.append("\n")
    para(t, main.title, width, "bold red", indent=2, first="  ")
    for f in rest[:others]:
        line = Text(f"  ● {f.title}", style="red", no_wrap=True)
        line.truncate(width, overflow="ellipsis")
        t.append_text(line)
        t.append("\n")
    if len(rest) > others:
        t.append(f"  +{len(rest) - others} more finding(s) here (f / F)\n", style="red")
    t.append("\n")


def finding_footer(t: Text, findings: Iterable[Any], width: int, selected: Any = None) -> None:
    """The selected (else first) finding's explanation, wrapped, under the picture."""
    main = _chosen(list(findings), selected)
    if main is None:
        return
    t.append("\nWhy\n", style="bold")
    para(t, main.explanation, width, "italic", indent=2, first="  ")
