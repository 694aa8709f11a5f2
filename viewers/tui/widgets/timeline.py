"""The step scrubber: a one-line timeline of engine steps with finding markers.

Line 1: the selected step, whether a finding is at it, and a legend of the marks;
line 2: the bar. ``┃`` (red) marks steps with findings, ``✗`` (yellow) steps where the
scheduler handled KV that failed to load (only in a trace that has one), ``╵`` the steps the
selected request has events at (``n`` / ``N`` jump between them), ``◆`` the selected step.
"""

from __future__ import annotations

from bisect import bisect_left

from rich.text import Text
from textual import events
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

LEGEND = (("┃", "bold red", "finding", "finding"), ("╵", "cyan", "request events", "req"),
          ("◆", "bold reverse", "selected", "here"))
LOAD_MARK = ("✗", "bold yellow", "KV load failed", "kv")


class StepScrubber(Widget):
    """Shows the selected step among all steps, with red ticks at steps with findings.

    Keys live on the app (left/right/home/end, n/N) so they work whatever pane has
    focus; a click on the bar jumps to the step under the mouse.
    """

    DEFAULT_CSS = """
    StepScrubber { height: 2; padding: 0 1; background: $boost; }
    """

    step: reactive[int | None] = reactive(None)

    class Scrubbed(Message):
        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.steps: list[int] = []
        self.marks: set[int] = set()
        self.load_marks: set[int] = set()
        self.req_steps: list[int] = []

    def set_steps(self, steps: list[int]) -> None:
        self.steps = steps
        self.refresh()

    def set_marks(self, marks: set[int]) -> None:
        self.marks = marks
        self.refresh()

    def set_load_marks(self, marks: set[int]) -> None:
        self.load_marks = marks
        self.refresh()

    def set_req_steps(self, steps: list[int]) -> None:
        self.req_steps = steps
        self.refresh()

    def _cell(self, s: int, width: int) -> int:
        return min(width - 1, bisect_left(self.steps, s) * width // len(self.steps))

    def _load_cells(self) -> set[int]:
        """The bar cells a load-failure mark shows in (a finding's mark wins a shared cell)."""
        if not self.steps or not self.load_marks:
            return set()
        w = self._bar_width()
        return {self._cell(s, w) for s in self.load_marks} - {self._cell(s, w) for s in self.marks}

    def _bar_width(self) -> int:
        return max(10, self.size.width - 2)

    def legend(self, room: int) -> Text:
        """The legend, in words when there is room, else the marks alone."""
        t = Text()
        legend = LEGEND[:1] + ((LOAD_MARK,) if self._load_cells() else ()) + LEGEND[1:]
        long = sum(len(w) + 4 for _, _, w, _ in legend)
        for mark, style, word, short in legend:
            t.append(mark, style=style)
            t.append(f" {word}  " if room >= long else f"{short} ", style="dim")
        return t

    def render(self) -> Text:
        n = len(self.steps)
        head = Text()
        if not n:
            head.append("steps: none yet", style="dim")
            return head
        pos = bisect_left(self.steps, self.step) if self.step is not None else 0
        head.append(f"step {self.step if self.step is not None else '-'}", style="bold")
        head.append(f" ({pos + 1}/{n}, {self.steps[0]}..{self.steps[-1]}) ", style="dim")
        if self.step in self.marks:
            head.append("● finding here ", style="bold red")
        elif self.step in self.load_marks:
            head.append("✗ KV load failed here ", style="bold yellow")
        width = self._bar_width()
        room = width - len(head.plain)
        legend = self.legend(room)
        if room > len(legend.plain):
            head.append(" " * (room - len(legend.plain)))
            head.append_text(legend)
        head.append("\n")
        cells = ["─"] * width
        styles = ["dim"] * width
        for s in self.req_steps:
            k = bisect_left(self.steps, s)
            c = min(width - 1, k * width // n)
            cells[c], styles[c] = "╵", "cyan"
        for s in self.load_marks:
            k = bisect_left(self.steps, s)
            c = min(width - 1, k * width // n)
            cells[c], styles[c] = LOAD_MARK[0], LOAD_MARK[1]
        for s in self.marks:
            k = bisect_left(self.steps, s)
            c = min(width - 1, k * width // n)
            cells[c], styles[c] = "┃", "bold red"
        c = min(width - 1, pos * width // n)
        cells[c], styles[c] = "◆", "bold reverse"
        for ch, st in zip(cells, styles):
            head.append(ch, style=st)
        return head

    def on_click(self, event: events.Click) -> None:
        if not self.steps or event.y < 1:
            return
        k = max(0, min(len(self.steps) - 1, (event.x - 1) * len(self.steps) // self._bar_width()))
        self.post_message(self.Scrubbed(self.steps[k]))
