"""The pdtrace TUI app: findings + requests on the left, step scrubber and panes on the right.

Data flow (memray/toolong style): the ``TraceIndex`` is injected; a thread worker
indexes the file in batches and posts ``IndexProgress``; when the index is complete the
same worker runs the detectors over lazily parsed events and posts ``FindingsReady``.
Widgets only render what ``viewers.tui.model`` computes for the current selection.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Header, Input, OptionList, ProgressBar, Static, TabbedContent, TabPane
from textual.worker import get_current_worker

from pdtrace.errors import PdtraceError
from pdtrace.index import TraceIndex

from . import model
from .commands import TraceCommands
from .messages import FindingsReady, IndexFailed, IndexProgress
from .widgets.help import HelpScreen
from .widgets.lists import FindingsList, RequestList
from .widgets.panes import AcceptedPane, BlockMapPane, MetadataPane, RawPane
from .widgets.timeline import StepScrubber

Detect = Callable[..., list]

# Which pane a finding kind is best seen in.
PANE_OF_KIND = {
    "lookahead-block-misalignment": "blocks",
    "drafter-window-outside-allocation": "raw",
    "connector-metadata-cleared-before-drafter": "meta",
    "stale-accepted-count-read": "acc",
}


# Above this file size the detectors (which take a list of parsed events) run on request only.
DETECT_MAX_BYTES = 256 << 20


def default_detect() -> Detect | None:
    try:
        from pdtrace.detectors import run_all  # type: ignore[attr-defined]
    except ImportError:
        return None
    return run_all


class PdtraceViewer(App):
    CSS_PATH = "app.tcss"
    TITLE = "pdtrace view"
    COMMANDS = App.COMMANDS | {TraceCommands}
    BINDINGS = [
        Binding("left", "step(-1)", "Step-", priority=True),
        Binding("right", "step(1)", "Step+", priority=True),
        Binding("home", "step_edge(0)", "First", priority=True, show=False),
        Binding("end", "step_edge(1)", "Last", priority=True, show=False),
        Binding("f", "next_finding(1)", "Next finding"),
        Binding("F", "next_finding(-1)", "Prev finding", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("D", "detect", "Run detectors", show=False),
        Binding("1", "tab('blocks')", "Blocks"),
        Binding("2", "tab('acc')", "Accepted"),
        Binding("3", "tab('meta')", "Metadata"),
        Binding("4", "tab('raw')", "Raw"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    req: reactive[str | None] = reactive(None, init=False)
    step: reactive[int | None] = reactive(None, init=False)

    def __init__(self, index: TraceIndex, *, detect: Detect | None = None, use_default_detect: bool = True,
                 scan: bool | None = None, batch_time: float = 0.1,
                 detect_max_bytes: int = DETECT_MAX_BYTES) -> None:
        super().__init__()
        self.index = index
        self.detect = detect if detect is not None else (default_detect() if use_default_detect else None)
        self.scan = (not index.done) if scan is None else scan
        self.batch_time = batch_time
        self.detect_max_bytes = detect_max_bytes
        self._force_detect = False
        self.findings: list[Any] = []
        self.finding: Any = None  # the finding last jumped to
        self.findings_done = False
        self.first_screen_at: float | None = None
        self.indexed = index.done
        self._known_reqs = 0
        self._bad_reqs: set[str] = set()
        self._trackers: dict[str, model.RowTracker] = {}
        self._filter = ""
        self._started = time.perf_counter()
        self._lists_at = 0.0

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner")
        yield ProgressBar(total=100, show_eta=False, id="progress")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield FindingsList(id="findings")
                yield Input(placeholder="/ filter requests by id", id="filter")
                yield RequestList(id="requests")
            with Vertical(id="right"):
                yield StepScrubber(id="scrubber")
                with TabbedContent(initial="blocks", id="tabs"):
                    with TabPane("1 Block map", id="blocks"):
                        yield BlockMapPane(id="pane-blocks")
                    with TabPane("2 Accepted counts", id="acc"):
                        yield AcceptedPane(id="pane-acc")
                    with TabPane("3 Connector metadata", id="meta"):
                        yield MetadataPane(id="pane-meta")
                    with TabPane("4 Raw events", id="raw"):
                        yield RawPane(id="pane-raw")
        yield Footer()

    def on_mount(self) -> None:
        import os

        self.sub_title = os.path.basename(self.index.path.rstrip("/")) if self.index.path else "(events)"
        self.query_one("#banner").display = False
        self.query_one(FindingsList).show([], "indexing..." if self.scan else "running detectors...")
        self.query_one(RequestList).border_title = "Requests"
        if self.scan:
            self._work()
        else:
            self.query_one("#progress").display = False
            self._after_index()
            self._work()

    # ------------------------------------------------------------------ background work
    @work(thread=True, exclusive=True, group="index")
    def _work(self) -> None:
        worker = get_current_worker()
        if self.scan:
            try:
                for prog in self.index.scan(batch_time=self.batch_time):
                    if worker.is_cancelled:
                        return
                    self.post_message(IndexProgress(prog))
            except PdtraceError as exc:
                self.post_message(IndexFailed(str(exc)))
                return
        if self.detect is None:
            self.post_message(FindingsReady([], "detectors unavailable (pdtrace.detectors.run_all not importable)"))
            return
        if self.index.size > self.detect_max_bytes and not self._force_detect:
            mb = self.index.size >> 20
            self.post_message(FindingsReady([], f"{mb} MiB trace: detectors not run automatically (they parse "
                                                "every event into memory); press D to run them, or use `pdtrace check`"))
            return
        try:
            # run_all takes a list (it indexes events by kind); the index itself keeps offsets only
            events = list(self.index.iter_events())
            if worker.is_cancelled:
                return
            findings = list(self.detect(events, header=self.index.header))
            del events
        except Exception as exc:  # a detector bug must not take the viewer down
            self.post_message(FindingsReady([], f"detectors failed: {type(exc).__name__}: {exc}"))
            return
        if not worker.is_cancelled:
            self.post_message(FindingsReady(findings))

    @on(IndexProgress)
    def _on_progress(self, msg: IndexProgress) -> None:
        p = msg.progress
        bar = self.query_one("#progress", ProgressBar)
        bar.update(total=100, progress=round(100 * p.fraction))
        now = time.perf_counter()
        if self.first_screen_at is None or now - self._lists_at > 2.0:  # lists are cheap to show, not to rebuild
            self._lists_at = now
            self._add_requests()
            self.query_one(StepScrubber).set_steps(self.index.steps_of())
            if self.step is None and self.query_one(StepScrubber).steps:
                self.step = self.query_one(StepScrubber).steps[0]
        if p.done:
            bar.display = False
            self._after_index()
        if self.first_screen_at is None:
            self.first_screen_at = time.perf_counter()

    def _after_index(self) -> None:
        self.indexed = True
        self._trackers.clear()
        self._add_requests(force=True)
        steps = self.index.steps_of()
        self.query_one(StepScrubber).set_steps(steps)
        if self.step is None and steps:
            self.step = steps[0]
        if self.index.problems:
            shown = "; ".join(str(p) for p in self.index.problems[:5])
            more = f" (+{len(self.index.problems) - 5} more)" if len(self.index.problems) > 5 else ""
            banner = self.query_one("#banner", Static)
            banner.update(f"⚠ damaged trace: {len(self.index.problems)} line(s) skipped: {shown}{more}")
            banner.display = True
        if not self.scan:
            self.query_one(FindingsList).show([], "running detectors...")
        self._refresh_panes()

    @on(IndexFailed)
    def _on_failed(self, msg: IndexFailed) -> None:
        banner = self.query_one("#banner", Static)
        banner.update(f"✗ cannot read trace: {msg.error}")
        banner.display = True
        self.query_one("#progress").display = False
        self.query_one(FindingsList).show([], "no findings: the trace could not be read")

    @on(FindingsReady)
    def _on_findings(self, msg: FindingsReady) -> None:
        self.findings = list(msg.findings)
        self.findings_done = True
        self._bad_reqs = {f.req for f in self.findings if f.req}
        note = msg.error or ("no findings" if not self.findings else "")
        self.query_one(FindingsList).show(self.findings, note)
        self.query_one(StepScrubber).set_marks({s for f in self.findings if (s := self._finding_step(f)) is not None})
        self._add_requests(force=True)
        self._refresh_panes()

    # ------------------------------------------------------------------ lists
    def _add_requests(self, force: bool = False) -> None:
        names = self.index.req_names
        if not force and len(names) == self._known_reqs:
            return
        self._known_reqs = len(names)
        flt = self._filter.lower()
        rows = [(r, " ".join(self.index.request_insts(r)), r in self._bad_reqs)
                for r in list(names) if flt in r.lower()]
        rows.sort(key=lambda x: not x[2])  # requests with findings first
        self.query_one(RequestList).show(rows, len(names), self._filter)

    @on(Input.Changed, "#filter")
    def _on_filter(self, event: Input.Changed) -> None:
        self._filter = event.value.strip()
        self._add_requests(force=True)

    @on(Input.Submitted, "#filter")
    def _on_filter_done(self) -> None:
        rl = self.query_one(RequestList)
        rl.focus()
        if rl.highlighted is None and rl.option_count:
            rl.highlighted = 0

    @on(OptionList.OptionHighlighted, "#requests")
    @on(OptionList.OptionSelected, "#requests")
    def _on_request(self, event: OptionList.OptionHighlighted) -> None:
        oid = event.option.id or ""
        if oid.startswith("r:"):
            self.req = oid[2:]

    @on(OptionList.OptionSelected, "#findings")
    def _on_finding(self, event: OptionList.OptionSelected) -> None:
        oid = event.option.id or ""
        if oid.startswith("f"):
            self.goto_finding(int(oid[1:]))

    @on(StepScrubber.Scrubbed)
    def _on_scrub(self, msg: StepScrubber.Scrubbed) -> None:
        self.step = msg.step

    @on(TabbedContent.TabActivated)
    def _on_tab(self) -> None:
        self._refresh_panes()

    # ------------------------------------------------------------------ navigation
    def _finding_step(self, f: Any) -> int | None:
        if f.step is not None:
            return f.step
        for eid in f.event_ids or []:
            i = self.index.ordinal(eid)
            if 0 <= i < len(self.index) and self.index.steps[i] >= 0:
                return self.index.steps[i]
        return None

    def goto_finding(self, k: int) -> None:
        if not 0 <= k < len(self.findings):
            return
        f = self.findings[k]
        self.finding = f
        fl = self.query_one(FindingsList)
        try:
            fl.highlighted = fl.get_option_index(f"f{k}")
        except Exception:
            pass
        if f.req:
            self.req = f.req
        step = self._finding_step(f)
        if step is not None:
            self.step = step
        self.query_one(TabbedContent).active = PANE_OF_KIND.get(f.kind, "raw")
        self._refresh_panes()

    def goto_request(self, req: str) -> None:
        self.req = req
        rl = self.query_one(RequestList)
        try:
            rl.highlighted = rl.get_option_index(f"r:{req}")
        except Exception:
            pass

    def goto_step(self, step: int) -> None:
        self.step = step

    def watch_req(self) -> None:
        self._refresh_panes()

    def watch_step(self) -> None:
        self.query_one(StepScrubber).step = self.step
        self._refresh_panes()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("step", "step_edge") and isinstance(self.focused, Input):
            return False  # let the filter box have its cursor keys
        return True

    def action_step(self, delta: int) -> None:
        steps = self.query_one(StepScrubber).steps
        if not steps:
            return
        if self.step is None:
            self.step = steps[0]
            return
        from bisect import bisect_left

        k = bisect_left(steps, self.step)
        if delta < 0:
            k -= 1
        elif k < len(steps) and steps[k] == self.step:
            k += 1
        self.step = steps[max(0, min(len(steps) - 1, k))]

    def action_step_edge(self, last: int) -> None:
        steps = self.query_one(StepScrubber).steps
        if steps:
            self.step = steps[-1] if last else steps[0]

    def action_next_finding(self, delta: int) -> None:
        if not self.findings:
            return
        k = self.findings.index(self.finding) if self.finding in self.findings else -1
        if k < 0:
            k = 0 if delta > 0 else len(self.findings) - 1
        else:
            k = (k + delta) % len(self.findings)
        self.goto_finding(k)

    def action_detect(self) -> None:
        if not self.indexed or self.findings:
            return
        self._force_detect = True
        self.scan = False
        self.findings_done = False
        self.query_one(FindingsList).show([], "running detectors...")
        self._work()

    def action_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())

    # ------------------------------------------------------------------ panes
    def _selection_findings(self, kinds: tuple[str, ...]) -> list[Any]:
        out = []
        for f in self.findings:
            if PANE_OF_KIND.get(f.kind) not in kinds:
                continue
            if kinds == ("blocks",):
                if f.req is not None and f.req == self.req or (self.req and self.req in str(f.data)):
                    out.append(f)
            elif self._finding_step(f) == self.step:
                out.append(f)
        return out

    def _refresh_panes(self) -> None:
        if not self.is_mounted:
            return
        tab = self.query_one(TabbedContent).active
        index = self.index
        if tab == "blocks":
            req = self.req
            if req is None:
                req = next((f.req for f in self.findings if f.req), None)
            self.query_one(BlockMapPane).show(model.block_map(index, req), req, self._selection_findings(("blocks",)))
        elif tab == "acc":
            views = model.accepted(index, self.step, self._trackers) if self.indexed else []
            self.query_one(AcceptedPane).show(views, self.step, self._selection_findings(("acc",)))
        elif tab == "meta":
            self.query_one(MetadataPane).show(model.metadata(index, self.step), self.step,
                                              self._selection_findings(("meta",)))
        elif tab == "raw":
            ords = model.raw_ordinals(index, self.req, self.step)
            what = " ".join(x for x in (f"request {self.req}" if self.req else "", f"step {self.step}"
                                        if self.step is not None else "") if x) or "first events"
            marked = set(self.finding.event_ids) if self.finding is not None else set()
            self.query_one(RawPane).show(index.events(ords), what, marked)
