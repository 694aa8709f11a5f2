"""The pdtrace TUI app: findings + requests on the left, step scrubber and panes on the right.

Data flow (memray/toolong style): the ``TraceIndex`` is injected; a thread worker
indexes the file in batches and posts ``IndexProgress`` (a trace from ``scan_child_bytes``
on is read and checked in a child process, ``pdtrace.index.child``, so the lines' parsing
does not take the UI's interpreter; the worker only appends each batch); when the index is complete the
same worker runs the detectors and the per-class coverage (``detecting.py``: in this
process, or for a big trace streamed in a child process started with the indexing) and
posts ``FindingsReady``. Widgets only render what ``viewers.tui.model`` / ``drafter``
compute for the current selection. Navigation keys live in ``navigation.py``, export
(finding as Markdown, screen as SVG) in ``export.py``.

Layout: the verdict comes first at any size. Under ``NARROW`` columns the left column
collapses (``s`` brings it back) and a verdict line above the tabs names the selected
finding; tab labels shorten; panes wrap prose to their width and scroll sideways where a
table is wider than the screen.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Header, Input, OptionList, ProgressBar, Static, TabbedContent, TabPane
from textual.worker import get_current_worker

from pdtrace.detectors import by_severity
from pdtrace.detectors.causes import group
from pdtrace.errors import PdtraceError
from pdtrace.index.trace_index import TraceIndex

from . import drafter, model, selection
from .commands import TraceCommands
from .export import ExportMixin
from .layout import TABS, LayoutMixin
from .detecting import DetectMixin
from .messages import DetectProgress, FindingsReady, IndexFailed, IndexProgress
from .navigation import NavigationMixin, pane_of
from .search import PLACEHOLDER, SearchInput, SearchMixin
from .widgets.accepted import AcceptedPane
from .widgets.lists import FindingsList, RequestList
from .widgets.panes import BlockMapPane, MetadataPane, RawPane
from .widgets.timeline import StepScrubber
from .widgets.window import WindowPane

Detect = Callable[..., list]

# Above this size (of the trace's text) the detectors run streamed in a child process
# (``detecting.py``); up to it, here over a list of parsed events.
DETECT_MAX_BYTES = 256 << 20
SCAN_CHILD_BYTES = 64 << 20  # a trace file from this size on is indexed in a child process
_STEP = Binding.Group("Step", compact=True)
_TABS = Binding.Group("Tab", compact=True)


def default_detect() -> Detect | None:
    try:
        from pdtrace.detectors import run_all  # type: ignore[attr-defined]
    except ImportError:
        return None
    return run_all


def default_coverage() -> Callable[..., dict] | None:
    try:
        from pdtrace.detectors.coverage import coverage
    except ImportError:
        return None
    return coverage


class PdtraceViewer(DetectMixin, LayoutMixin, NavigationMixin, ExportMixin, SearchMixin, App):
    CSS_PATH = "app.tcss"
    TITLE = "pdtrace view"
    COMMANDS = App.COMMANDS | {TraceCommands}
    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),  # (Help and Quit first: a narrow key bar drops its last hints)
        Binding("left", "step(-1)", "Step-", priority=True, group=_STEP),
        Binding("right", "step(1)", "Step+", priority=True, group=_STEP),
        Binding("home", "step_edge(0)", "First", priority=True, show=False),
        Binding("end", "step_edge(1)", "Last", priority=True, show=False),
        Binding("f", "next_finding(1)", "Find"),
        Binding("F", "next_finding(-1)", "Prev finding", show=False),
        Binding("n", "req_step(1)", "Req"),
        Binding("N", "req_step(-1)", "Prev req step", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("e", "search", "Search"),
        Binding("s", "toggle_side", "Side"),
        Binding("c", "copy_finding", "Copy"),
        Binding("S", "save_svg", "Save SVG", show=False),
        Binding("g", "group", "Group findings", show=False),
        Binding("D", "detect", "Run detectors", show=False),
        Binding("E", "search_prev", "Previous match", show=False),
        Binding("escape", "close_search", show=False),
    ] + [Binding(str(k + 1), f"tab('{tid}')", short.split()[1], show=False, group=_TABS)
         for k, (tid, _, short) in enumerate(TABS)]

    req: reactive[str | None] = reactive(None, init=False)
    step: reactive[int | None] = reactive(None, init=False)

    def __init__(self, index: TraceIndex, *, detect: Detect | None = None, use_default_detect: bool = True,
                 scan: bool | None = None, batch_time: float = 0.1,
                 detect_max_bytes: int = DETECT_MAX_BYTES, export_dir: str | None = None,
                 scan_child_bytes: int = SCAN_CHILD_BYTES) -> None:
        super().__init__()
        self.index = index
        self.detect = detect if detect is not None else (default_detect() if use_default_detect else None)
        self.cover = default_coverage() if use_default_detect else None
        self._default_detect = detect is None and use_default_detect
        self.scan = (not index.done) if scan is None else scan
        self.batch_time = batch_time
        self.scan_child = self.scan and index._memory is None and index.size >= scan_child_bytes
        self.detect_max_bytes = detect_max_bytes
        self.export_dir = export_dir or os.getcwd()
        self.last_export: str | None = None
        self._force_detect = False
        self.findings: list[Any] = []
        self.coverage: dict[str, Any] | None = None
        self.notes: dict[str, list] | None = None  # the detectors' facts (kv-never-crossed: per instance pair)
        self.finding: Any = None  # the finding last jumped to
        self.findings_done = False
        self.findings_note = ""
        self.first_screen_at: float | None = None
        self.indexed = index.done
        self.group_by = "class"
        self._known_reqs = 0
        self._bad_reqs: set[str] = set()
        self._matched: dict[str, str] = {}
        self._trackers: dict[str, model.RowTracker] = {}
        self._filter = ""
        self._pending: list[tuple[str, int]] = []
        self._user_moved = False  # a key or a click before the detectors reported: they do not move the view
        self._side_override: bool | None = None
        self._narrow: bool | None = None
        self._lists_at = 0.0
        self._prepare_job()

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner")
        yield ProgressBar(total=100, show_eta=False, id="progress")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield FindingsList(id="findings")
                yield Input(placeholder="/ filter findings and requests", id="filter")
                yield RequestList(id="requests")
            with Vertical(id="right"):
                yield StepScrubber(id="scrubber")
                yield Static("", id="verdict")
                with TabbedContent(initial="blocks", id="tabs"):
                    for tid, label, _ in TABS:
                        with TabPane(label, id=tid):
                            if tid == "raw":
                                yield SearchInput(placeholder=PLACEHOLDER, id="rawsearch")
                            yield {"blocks": BlockMapPane, "acc": AcceptedPane, "meta": MetadataPane,
                                   "window": WindowPane, "raw": RawPane}[tid](id=f"pane-{tid}")
        yield Footer()

    def on_mount(self) -> None:
        name = getattr(self.index, "source", None) or self.index.path  # (a .zst's name, not its temporary copy's)
        self.sub_title = os.path.basename(name.rstrip("/")) if name else "(events)"
        self.query_one("#banner").display = False
        if self._streamed():  # (the list is ~30 columns wide)
            self.query_one(FindingsList).show([], "indexing + background check...")
        else:
            self.query_one(FindingsList).show([], "indexing..." if self.scan else "running detectors...")
        self.query_one(RequestList).border_title = "Requests"
        self._apply_layout()
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
        self._start_job()  # a big trace: its streamed check starts with the indexing (detecting.py)
        try:
            if self.scan:
                try:
                    for prog in self.index.scan(batch_time=self.batch_time, child=self.scan_child):
                        if worker.is_cancelled:
                            return
                        self.post_message(IndexProgress(prog))
                except PdtraceError as exc:
                    self.post_message(IndexFailed(str(exc)))
                    return
            self._run_detectors(worker)
        finally:
            self._cancel_job()  # (None once its findings are in)

    @on(DetectProgress)
    def _on_detect_progress(self, msg: DetectProgress) -> None:
        if not self.findings_done:
            self.query_one(FindingsList).show([], f"checking the {self.index.size >> 20} MiB trace in a "
                                                  f"background process: {round(100 * msg.fraction)}%")

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
        loads = self.index.kind_ordinals("kvload.handled")
        self.query_one(StepScrubber).set_load_marks({s for i in loads if (s := self.index.steps[i]) is not None
                                                     and s >= 0})
        if self.step is None and steps:
            self.step = steps[0]
        if self.index.problems:
            shown = "; ".join(str(p) for p in self.index.problems[:5])
            more = f" (+{len(self.index.problems) - 5} more)" if len(self.index.problems) > 5 else ""
            banner = self.query_one("#banner", Static)
            banner.update(f"⚠ damaged trace, read leniently (check / report need --lenient): {shown}{more}")
            banner.display = True
        if not self.scan:
            self.query_one(FindingsList).show([], "running detectors...")
        self._run_pending("index")
        self._refresh_panes()

    @on(IndexFailed)
    def _on_failed(self, msg: IndexFailed) -> None:
        banner = self.query_one("#banner", Static)
        banner.update(f"✗ cannot read trace: {msg.error}")
        banner.display = True
        self.query_one("#progress").display = False
        self._pending.clear()
        self.query_one(FindingsList).show([], "no findings: the trace could not be read")

    @on(FindingsReady)
    def _on_findings(self, msg: FindingsReady) -> None:
        self.findings = by_severity(msg.findings)  # errors first, as check lists them
        self.coverage, self.notes = msg.coverage, msg.notes
        self.findings_done = True
        self.findings_note = msg.error
        self._bad_reqs = {f.req for f in self.findings if f.req}
        self._matched = selection.matched_pairs(self.findings)
        self._show_findings()
        self.query_one(StepScrubber).set_marks({s for f in self.findings if (s := self._finding_step(f)) is not None})
        self._add_requests(force=True)
        kept_f = any(what == "finding" for what, _arg in self._pending)  # (f pressed early: it goes there itself)
        if self.findings and not kept_f and not self._user_moved:  # not navigated yet: open on the first root cause
            # (after the next refresh: a tab switch made while the tabs still settle their first tab is lost)
            self.call_after_refresh(self._open_first_cause)
        elif self.req is None:  # something to show without the request list (hidden when narrow)
            rows = selection.request_rows(self.index, self._bad_reqs)
            first = next((f.req for f in self.findings if f.req), rows[0][0] if rows else None)
            if first is not None:
                self.goto_request(first)
                # and the scrubber to its finding's step, once: the user has not navigated yet
                f0 = next((f for f in self.findings if f.req == first), None)
                step = self._finding_step(f0) if f0 is not None else None
                if step is not None:
                    self.step = step
        self._update_verdict()
        self._run_pending("findings")
        self._refresh_panes()

    def _open_first_cause(self) -> None:
        """The first root cause's first finding, selected in the pane that shows it, unless the user
        moved meanwhile; the focus on what is shown (a hidden findings list gives it up)."""
        if self._user_moved or not self.findings or not self.query(TabbedContent):
            return
        self.goto_finding(group(self.findings)[0].first["index"])
        self._apply_layout()

    # ------------------------------------------------------------------ lists
    def _show_findings(self) -> None:
        note = self.findings_note or ("no findings" if not self.findings else "")
        self.query_one(FindingsList).show(self.findings, note, by=self.group_by, flt=self._filter,
                                          coverage=self.coverage, notes=self.notes)

    def _add_requests(self, force: bool = False) -> None:
        names = self.index.req_names
        if not force and len(names) == self._known_reqs:
            return
        self._known_reqs = len(names)
        rows = selection.request_rows(self.index, self._bad_reqs, self._filter, self._matched)
        self.query_one(RequestList).show(rows, len(names), self._filter)

    @on(Input.Changed, "#filter")
    def _on_filter(self, event: Input.Changed) -> None:
        self._filter = event.value.strip()
        self._add_requests(force=True)
        if self.findings_done:
            self._show_findings()

    @on(Input.Submitted, "#filter")
    def _on_filter_done(self) -> None:
        fl = self.query_one(FindingsList)
        target = fl if any((fl.get_option_at_index(i).id or "").startswith("f") for i in range(fl.option_count)) \
            else self.query_one(RequestList)
        target.focus()
        if target.highlighted is None and target.option_count:
            for i in range(target.option_count):
                if not target.get_option_at_index(i).disabled:
                    target.highlighted = i
                    break

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

    def on_key(self, _event: Any) -> None:
        self._user_moved = True

    def on_click(self, _event: Any) -> None:
        self._user_moved = True

    @on(TabbedContent.TabActivated)
    def _on_tab(self) -> None:
        if not self.query(TabbedContent):  # (a tab switch that arrives as the app closes)
            return
        self._refresh_panes()

    def watch_req(self) -> None:
        if self.indexed:
            self.query_one(StepScrubber).set_req_steps(selection.request_steps(self.index, self.req))
        self._refresh_panes()

    def watch_step(self) -> None:
        self.query_one(StepScrubber).step = self.step
        self._refresh_panes()

    def action_detect(self) -> None:
        if not self.indexed or self.findings:
            return
        self._force_detect = True
        self.scan = False
        self.findings_done = False
        self.query_one(FindingsList).show([], "running detectors...")
        self._work()

    # ------------------------------------------------------------------ panes
    def _pair(self) -> tuple[str | None, str | None]:
        req = self.req
        if req is None:
            req = next((f.req for f in self.findings if f.req), None)
        if not req:
            return None, None
        p, d = model.pair_requests(self.index, req)
        return (p, d) if p or d else (req, None)  # a request of an instance that is neither P nor D

    def _selection_findings(self, tab: str) -> list[Any]:
        pair = [r for r in self._pair() if r]
        out = []
        for f in self.findings:
            pane = pane_of(f)
            if tab in ("blocks", "window"):
                if pane in (("blocks", "window") if tab == "blocks" else ("window",)) and \
                        (f.req in pair or any(r in str(f.data) for r in pair)):
                    out.append(f)
            elif pane == tab and self._finding_step(f) == self.step:
                out.append(f)
        return out

    def _refresh_panes(self) -> None:
        if not self.is_mounted:
            return
        tab = self.query_one(TabbedContent).active
        try:
            self._draw_pane(tab)
        except Exception as exc:  # a malformed event must not take the viewer down
            self.notify(f"cannot draw the {tab} pane here: {type(exc).__name__}: {exc}", severity="error")

    def _tabs_of(self, req: str | None) -> str:
        """The tabs other than the Block map that show ``req``'s findings ("tab 2 Acc"), for an empty map."""
        short = {t[0]: t[2] for t in TABS}
        tabs = sorted({short[p] for f in self.findings if f.req == req
                       and (p := pane_of(f)) != "blocks"})
        return ", ".join(f"tab {t}" for t in tabs)

    def _draw_pane(self, tab: str) -> None:
        index = self.index
        sel = self.finding
        if tab in ("blocks", "window"):
            req = self.req or next((f.req for f in self.findings if f.req), None)
            pair = [r for r in self._pair() if r]
            ws = drafter.windows(index, pair, self.findings) if self.indexed else []
            fs = self._selection_findings(tab)
            if tab == "blocks":
                bm = model.block_map(index, req)
                empty = bm is None and not ws
                self.query_one(BlockMapPane).show(bm, req, fs, sel, ws, self._tabs_of(req) if empty else "")
            else:
                self.query_one(WindowPane).show(ws, req, self.step, fs, sel)
        elif tab == "acc":
            views = (model.accepted(index, self.step, self._trackers, self.findings if self.findings_done else None)
                     if self.indexed else [])
            self.query_one(AcceptedPane).show(views, self.step, self._selection_findings("acc"), sel)
        elif tab == "meta":
            self.query_one(MetadataPane).show(model.metadata(index, self.step), self.step,
                                              self._selection_findings("meta"), sel)
        elif tab == "raw":
            marked = set(self.finding.event_ids) if self.finding is not None else set()
            hit = self.search_view()
            if hit is not None:
                self.query_one(RawPane).show(index.events(hit[0]), hit[1], marked, hit[2])
                return
            ords = model.raw_ordinals(index, self.req, self.step)
            what = (" ".join(x for x in (f"request {self.req}" if self.req else "", f"step {self.step}"
                                         if self.step is not None else "") if x) or "first events") + "  (e: search)"
            self.query_one(RawPane).show(index.events(ords), what, marked)
