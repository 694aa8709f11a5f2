"""The viewer's layout for the terminal size: the verdict first at any width.

Under ``NARROW`` columns the left column (findings, filter, requests) collapses -- ``s``
brings it back -- and a verdict line above the tabs names the selected finding (panes
then do not repeat it); tab labels shorten when the tab bar is narrow; the footer drops
the command-palette hint below 120 columns. Help (``?``) and Quit (``q``) come first on the
key bar (app.py's binding order), so a narrow bar drops its last hints (Copy, Side, Search)
and keeps those two from 60 columns on.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Footer, Static, TabbedContent

from .widgets.base import Pane
from .widgets.lists import MARKS, SHORT, short_title

NARROW = 100  # below this many columns the left column collapses
TABS = (  # id, long label, short label
    ("blocks", "1 Block map", "1 Blocks"),
    ("acc", "2 Accepted counts", "2 Acc"),
    ("meta", "3 Connector metadata", "3 Meta"),
    ("window", "4 Drafter window", "4 Window"),
    ("raw", "5 Raw events", "5 Raw"),
)


class LayoutMixin:
    findings: list[Any]
    finding: Any
    findings_done: bool
    findings_note: str
    coverage: dict[str, Any] | None
    _side_override: bool | None
    _narrow: bool | None

    def on_resize(self, event) -> None:
        self._apply_layout(event.size.width)

    def _side_shown(self) -> bool:
        return self._side_override if self._side_override is not None else not self._narrow

    def _apply_layout(self, width: int | None = None) -> None:
        if not self.is_mounted:  # type: ignore[attr-defined]
            return
        width = width if width is not None else self.size.width  # type: ignore[attr-defined]
        self._width = width
        narrow = width < NARROW
        if narrow != self._narrow:
            self._narrow = narrow
            self._side_override = None  # crossing the breakpoint goes back to the default
        side = self._side_shown()
        left = self.query_one("#left")
        focused = self.focused  # type: ignore[attr-defined]
        if not side and focused is not None and left in focused.ancestors:
            # keys must not go to a hidden list or filter box: focus the pane shown
            tabs = self.query_one(TabbedContent)
            self.set_focus(self.query_one(f"#pane-{tabs.active}"))  # type: ignore[attr-defined]
        left.display = side
        left.styles.width = 44 if width >= 160 else 40 if width >= 120 else 34
        right_w = width - (left.styles.width.value if side else 0)
        tabs = self.query_one(TabbedContent)
        for tid, long, short in TABS:
            tabs.get_tab(tid).label = Text(long if right_w >= 96 else short)
        footer = self.query_one(Footer)
        footer.compact = width < 80
        footer.show_command_palette = width >= 120
        self._update_verdict()

    def _toggle_layout(self) -> None:
        self._apply_layout(getattr(self, "_width", None))

    def _update_verdict(self) -> None:
        """The one or two lines above the tabs naming the selected finding (shown when the
        findings list is hidden)."""
        if not self.is_mounted:
            return
        v = self.query_one("#verdict", Static)
        v.display = not self._side_shown()
        for pane in self.query(Pane):
            pane.set_verdict_above(v.display and self.finding is not None)
        t = Text()
        f = self.finding
        if f is not None and f in self.findings:
            k = self.findings.index(f)
            mark, style = MARKS.get(f.severity, MARKS["warning"])  # (● error, ▲ warning, ? inconclusive)
            t.append(f"{mark}{k + 1}/{len(self.findings)} {f.severity} {SHORT.get(f.kind, f.kind)} ", style=style)
            where = " ".join(x for x in (f.req or "", f"s{f.step}" if f.step is not None else "", f.inst or "") if x)
            t.append(f"{where}: ", style="cyan")
            t.append(short_title(f), style="red")
        elif not self.findings_done:
            t.append("indexing / running detectors... (f is kept until they report)", style="dim")
        elif self.findings:
            t.append(f"● {len(self.findings)} finding(s)", style="bold red")
            t.append("  f: first finding   s: findings list", style="dim")
        else:
            t.append(self.findings_note or "no findings", style="bold green")
            unchecked = [k for k, c in (self.coverage or {}).items() if c.status == "not-checked"]
            if unchecked:
                t.append(f"  not checked: {', '.join(SHORT.get(k, k) for k in unchecked)} (s: why)", style="yellow")
        v.update(t)

