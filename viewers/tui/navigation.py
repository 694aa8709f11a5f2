"""Keyboard navigation of the viewer: steps, findings, a request's steps, tabs, filter,
grouping, the side panel. ``NavigationMixin`` is mixed into ``PdtraceViewer``.

Keys that need what the background worker has not produced yet (findings, the full step
list) are kept and carried out when it arrives, never dropped: ``f`` pressed while the
trace is indexed jumps to the first finding once the detectors report.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

from textual.widgets import Input, TabbedContent

from . import selection
from .widgets.help import HelpScreen
from .widgets.lists import FindingsList, RequestList, select_option
from .widgets.timeline import StepScrubber

# Which pane a finding kind is best seen in.
PANE_OF_KIND = {
    "lookahead-block-misalignment": "blocks",
    "drafter-window-outside-allocation": "window",
    "connector-metadata-cleared-before-drafter": "meta",
    "stale-accepted-count-read": "acc",
    "kv-load-failure-recovery": "blocks",  # the request's blocks, where the failed ones sit
    "kv-never-crossed": "raw",  # its req.add (no params) and first allocation (nothing loaded): no block map to show
    "kv-invariant": "blocks",  # the block it read, what it held and the pairs that filled it (the drafter's write: window)
}


def pane_of(f: Any) -> str:
    """The pane a finding is best seen in: its kind's, but a drafter group that never got its KV (kv-never-crossed)
    shows on the Block map, which says per group what the load brought, and so does a read of blocks P had
    released (the finding, with its explanation, heads the pairs that look right)."""
    mech = (getattr(f, "data", None) or {}).get("mechanism")
    if mech in ("drafter-group", "expired-lease"):
        return "blocks"  # (its pairs look right: the finding above them says what they read)
    if mech in ("write-outside", "in-flight"):  # (kv-invariant: the drafter's write window; the step's events)
        return "window" if mech == "write-outside" else "raw"
    return PANE_OF_KIND.get(f.kind, "raw")


class NavigationMixin:
    findings: list[Any]
    finding: Any
    findings_done: bool
    indexed: bool
    req: str | None
    step: int | None

    # ------------------------------------------------------------------ pending keys
    def _defer(self, what: str, arg: int, why: str) -> None:
        self._pending.append((what, arg))  # type: ignore[attr-defined]
        self.notify(f"{why}: the key is kept and done when it is ready", timeout=3)  # type: ignore[attr-defined]

    def _run_pending(self, ready: str) -> None:
        """Carry out the kept keys ``ready`` makes possible (``index`` or ``findings``)."""
        keep = []
        for what, arg in self._pending:  # type: ignore[attr-defined]
            if what == "finding" and ready == "findings":
                self.action_next_finding(arg)
            elif what in ("req_step", "edge") and ready == "index":
                (self.action_req_step if what == "req_step" else self.action_step_edge)(arg)
            else:
                keep.append((what, arg))
        self._pending[:] = keep  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ goto
    def _finding_step(self, f: Any) -> int | None:
        if f.step is not None:
            return f.step
        index = self.index  # type: ignore[attr-defined]
        for eid in f.event_ids or []:
            i = index.ordinal(eid)
            if 0 <= i < len(index) and index.steps[i] >= 0:
                return index.steps[i]
        return None

    def goto_finding(self, k: int) -> None:
        if not 0 <= k < len(self.findings):
            return
        f = self.findings[k]
        self.finding = f
        select_option(self.query_one(FindingsList), f"f{k}")  # type: ignore[attr-defined]
        if f.req:
            self.goto_request(f.req)
        step = self._finding_step(f)
        if step is not None:
            self.step = step
        self.query_one(TabbedContent).active = pane_of(f)  # type: ignore[attr-defined]
        self._update_verdict()  # type: ignore[attr-defined]
        self._refresh_panes()  # type: ignore[attr-defined]

    def goto_request(self, req: str) -> None:
        self.req = req
        select_option(self.query_one(RequestList), f"r:{req}")  # type: ignore[attr-defined]

    def goto_step(self, step: int) -> None:
        self.step = step

    # ------------------------------------------------------------------ actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("step", "step_edge") and isinstance(self.focused, Input):  # type: ignore[attr-defined]
            return False  # let the filter box have its cursor keys
        return True

    def action_step(self, delta: int) -> None:
        steps = self.query_one(StepScrubber).steps  # type: ignore[attr-defined]
        if not steps:
            return
        if self.step is None:
            self.step = steps[0]
            return
        k = bisect_left(steps, self.step)
        if delta < 0:
            k -= 1
        elif k < len(steps) and steps[k] == self.step:
            k += 1
        self.step = steps[max(0, min(len(steps) - 1, k))]

    def action_step_edge(self, last: int) -> None:
        if not self.indexed:
            self._defer("edge", last, "still indexing")
        steps = self.query_one(StepScrubber).steps  # type: ignore[attr-defined]
        if steps:
            self.step = steps[-1] if last else steps[0]

    def action_next_finding(self, delta: int) -> None:
        if not self.findings_done:
            self._defer("finding", delta, "the detectors are still running")
            return
        if not self.findings:
            self.notify("no findings in this trace")  # type: ignore[attr-defined]
            return
        order = self._finding_order()
        k = self.findings.index(self.finding) if self.finding in self.findings else -1
        if k not in order:
            k = order[0] if delta > 0 else order[-1]
        else:
            k = order[(order.index(k) + delta) % len(order)]
        self.goto_finding(k)

    def _finding_order(self) -> list[int]:
        """The findings the list shows (filtered), in their numbers' order: `f` goes 1, 2, 3 as
        `check` numbers them, whatever the list's grouping (by class or request) puts between."""
        fl = self.query_one(FindingsList)  # type: ignore[attr-defined]
        ids = [fl.get_option_at_index(i).id or "" for i in range(fl.option_count)]
        order = sorted(int(x[1:]) for x in ids if x.startswith("f"))
        return order or list(range(len(self.findings)))

    def action_req_step(self, delta: int) -> None:
        """The next / previous step at which the selected request has events."""
        if not self.req:
            self.notify("select a request first (left, or f for a finding)")  # type: ignore[attr-defined]
            return
        if not self.indexed:
            self._defer("req_step", delta, "still indexing")
            return
        steps = selection.request_steps(self.index, self.req)  # type: ignore[attr-defined]
        if not steps:
            self.notify(f"request {self.req} has no events at any step")  # type: ignore[attr-defined]
            return
        cur = self.step if self.step is not None else (steps[0] - 1 if delta > 0 else steps[-1] + 1)
        if delta > 0:
            k = bisect_right(steps, cur)
            target = steps[k] if k < len(steps) else None
        else:
            k = bisect_left(steps, cur) - 1
            target = steps[k] if k >= 0 else None
        if target is None:
            self.notify(f"no {'later' if delta > 0 else 'earlier'} step with events of {self.req}")  # type: ignore[attr-defined]
            return
        self.step = target

    def action_filter(self) -> None:
        if not self._side_shown():  # type: ignore[attr-defined]
            self.action_toggle_side()
        self.query_one("#filter", Input).focus()  # type: ignore[attr-defined]

    def action_toggle_side(self) -> None:
        self._side_override = not self._side_shown()  # type: ignore[attr-defined]
        self._toggle_layout()  # type: ignore[attr-defined]

    def action_group(self) -> None:
        self.group_by = "request" if self.group_by == "class" else "class"  # type: ignore[attr-defined]
        self._show_findings()  # type: ignore[attr-defined]

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab  # type: ignore[attr-defined]

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):  # type: ignore[attr-defined]
            self.pop_screen()  # type: ignore[attr-defined]
        else:
            self.push_screen(HelpScreen())  # type: ignore[attr-defined]
