"""Full-text search of the raw events (``e``): ``SearchMixin`` is mixed into ``PdtraceViewer``.

``e`` opens the search line above the Raw events tab; Enter (or down) finds the next event
whose JSON line contains the text (case-insensitive; ``#N`` is event id N), up the previous
one; Esc closes the line, after which ``E`` still goes to the previous match. The search runs in a worker thread over the file's bytes
(``pdtrace.index.search``: no event is parsed), so a multi-GB trace does not freeze the
screen. A match moves the step scrubber to the event's step and the Raw tab shows the event
highlighted at its top, followed by the events after it, until the step or request changes.
"""

from __future__ import annotations

from typing import Any

from textual import work
from textual.binding import Binding
from textual.widgets import Input, TabbedContent

from .messages import SearchDone

CONTEXT_BEFORE, CONTEXT_AFTER = 0, 16  # the match first: an event takes ~13 lines in the pane
PLACEHOLDER = "search raw events (text, #id): Enter/↓ next, ↑ previous, Esc close"


class SearchInput(Input):
    """The search line: up / down step through the matches without leaving it."""

    BINDINGS = [Binding("down", "app.search_step(1)", "Next match", show=False),
                Binding("up", "app.search_step(-1)", "Previous match", show=False)]


class SearchMixin:
    index: Any
    step: int | None
    req: str | None
    raw_hit: int | None = None  # ordinal of the last match
    _hit_at: tuple = ()  # (step, req) when it was found: the Raw tab shows it while they hold
    _last_query = ""

    def action_search(self) -> None:
        self.query_one(TabbedContent).active = "raw"  # type: ignore[attr-defined]
        box = self.query_one("#rawsearch", Input)  # type: ignore[attr-defined]
        box.display = True
        if not box.value and self._last_query:
            box.value = self._last_query
        box.focus()

    def action_search_step(self, direction: int) -> None:
        q = self.query_one("#rawsearch", Input).value.strip() or self._last_query  # type: ignore[attr-defined]
        if q:
            self._start_search(q, direction)

    def action_search_prev(self) -> None:
        if self._last_query:
            self._start_search(self._last_query, -1)
        else:
            self.action_search()

    def action_close_search(self) -> None:
        flt = self.query_one("#filter", Input)  # type: ignore[attr-defined]
        if flt.has_focus:  # escape leaves the filter box, clearing it (a key typed there by mistake)
            flt.value = ""
            self.query_one("#findings").focus()  # type: ignore[attr-defined]
            return
        box = self.query_one("#rawsearch", Input)  # type: ignore[attr-defined]
        if box.display:
            box.display = False
            self.query_one(TabbedContent).focus()  # type: ignore[attr-defined]

    # (named handlers: Textual's @on does not reach handlers defined on a plain mixin class)
    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "rawsearch":
            return
        q = event.value.strip()
        if q:
            self._start_search(q, 1)

    def _start_search(self, q: str, direction: int) -> None:
        hit = self.raw_hit if self._hit_valid() else None
        if hit is not None and q == self._last_query:
            start = hit + direction
        elif direction > 0:
            start = self._step_start()
        else:
            start = len(self.index) - 1
        self._last_query = q
        if not 0 <= start < len(self.index):
            self.notify(f"no {'later' if direction > 0 else 'earlier'} event contains {q!r}", timeout=3)  # type: ignore[attr-defined]
            return
        self._search_worker(q, start, direction)

    def _step_start(self) -> int:
        """The first ordinal of the current step (search from where the user is), else 0."""
        if self.step is None:
            return 0
        ords = self.index.step_ordinals(self.step)
        return ords[0] if ords else 0

    @work(thread=True, exclusive=True, group="search")
    def _search_worker(self, q: str, start: int, direction: int) -> None:
        try:
            o = self.index.search(q, start, direction)
        except Exception as exc:  # a search must not take the viewer down
            self.notify(f"search failed: {type(exc).__name__}: {exc}", severity="error")  # type: ignore[attr-defined]
            return
        self.post_message(SearchDone(q, o, direction))  # type: ignore[attr-defined]

    def on_search_done(self, msg: SearchDone) -> None:
        if msg.ordinal is None:
            self.notify(f"no {'later' if msg.direction > 0 else 'earlier'} event contains {msg.query!r}",  # type: ignore[attr-defined]
                        timeout=3)
            return
        o = msg.ordinal
        self.raw_hit = o
        st = self.index.steps[o]
        step = st if st >= 0 else self.step
        self._hit_at = (step, self.req)
        self.query_one(TabbedContent).active = "raw"  # type: ignore[attr-defined]
        if step != self.step:
            self.step = step  # watch_step redraws the panes
        else:
            self._refresh_panes()  # type: ignore[attr-defined]

    def _hit_valid(self) -> bool:
        return self.raw_hit is not None and self._hit_at == (self.step, self.req)

    def search_view(self) -> tuple[list[int], str, int] | None:
        """What the Raw tab shows while a match holds: (ordinals, heading, matched event id)."""
        if not self._hit_valid():
            return None
        o = self.raw_hit
        assert o is not None
        ords = list(range(max(0, o - CONTEXT_BEFORE), min(len(self.index), o + CONTEXT_AFTER)))
        eid = self.index.event_id(o)
        head = (f"search {self._last_query!r}: match #{eid}, then the events after it (in the search line "
                f"Enter/↓ next, ↑ previous; Esc closes it; a step or request key leaves the search)")
        return ords, head, eid
