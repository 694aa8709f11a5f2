"""The viewer's issue-21 features, driven through Textual's Pilot with the real detectors:
the drafter-window picture (the committed DFlash samples and a hand-built row-reuse trace
whose outside write hits a shared prefix-cache block), the collapsing side panel and
sideways scroll, one-line grouped findings with per-class coverage, n / N over a
request's steps, keys kept while the detectors run, and export (Markdown, SVG)."""

from __future__ import annotations

import pathlib
import sys
import threading

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import eventlib as E  # noqa: E402
from test_tui import _ready, _red_spans, _trace, stale_events  # noqa: E402

from pdtrace.detectors import run_all  # noqa: E402
from pdtrace.detectors.coverage import coverage  # noqa: E402
from pdtrace.index.trace_index import TraceIndex  # noqa: E402
from pdtrace.tracefile.trace import make_header, write_trace  # noqa: E402
from pdtrace.viewers.tui import selection  # noqa: E402
from pdtrace.viewers.tui.app import PdtraceViewer  # noqa: E402
from pdtrace.viewers.tui.widgets.lists import FindingsList, RequestList  # noqa: E402

SAMPLES = pathlib.Path(__file__).resolve().parent.parent / "sample_traces"


def _app(path, **kw) -> PdtraceViewer:
    return PdtraceViewer(TraceIndex(str(path)), **kw)


def _flat(text: str) -> str:
    """Pane text with line wrapping undone (prose is wrapped to the pane's width)."""
    return " ".join(text.split())


def _options(ol) -> list:
    return [ol.get_option_at_index(i) for i in range(ol.option_count)]


# ------------------------------------------------------------------------------ drafter window
@pytest.mark.asyncio
async def test_f_on_dflash_sample_lands_on_window_picture_red_past_allocation():
    app = _app(SAMPLES / "dflash_window_buggy.jsonl")
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        # (and the KV invariant's own finding of the same write: it opens on the same window picture)
        assert [f.kind for f in app.findings] == ["drafter-window-outside-allocation", "kv-invariant"]
        f = app.findings[0]
        await pilot.press("f")
        await pilot.pause()
        assert app.query_one("TabbedContent").active == "window"
        text = app.query_one("#pane-window").text
        d = f.data
        assert f"window [{d['start']}, {d['end']})" in text
        assert f"past the allocation (slot {d['capacity']} and on)" in _flat(text)
        # the block index past the allocation is drawn as not owned, with the outside position
        bi = d["blocks"][0]["block_index"]
        assert f"{bi:>6}  not owned" in text
        assert "OUTSIDE: no block owned here: the block-table entry is stale or padding" in _flat(text)
        red = _red_spans(app, "window")
        assert any("OUTSIDE THE ALLOCATION" in s for s in red)
        assert any("not owned" in s for s in red)
        # the block map of the pair says so too, instead of only "ok" pairs
        await pilot.press("1")
        await pilot.pause()
        assert "DRAFTER WRITES PAST THE ALLOCATION" in app.query_one("#pane-blocks").text


@pytest.mark.asyncio
async def test_dflash_fixed_sample_window_is_inside_and_not_red():
    app = _app(SAMPLES / "dflash_window_fixed.jsonl")
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        assert app.findings == []
        req = next(r for r in app.index.req_names if app.index.request_ordinals(r, ["spec.window"]))
        app.goto_request(req)
        await pilot.press("4")
        await pilot.pause()
        text = app.query_one("#pane-window").text
        assert "all inside the allocation" in text and "window [" in text
        assert _red_spans(app, "window") == []


@pytest.mark.asyncio
async def test_window_names_the_shared_prefix_cache_block_an_outside_write_hits(tmp_path):
    """eventlib's 003 scenario: row 0 first held 'old' (blocks 5, 6, 7); 'new' takes the row
    with one block and DFlash writes positions 16..19: block index 1 is the stale entry 6,
    which 'a' and 'b' hold from the prefix cache."""
    path = E.window_scenario().write(tmp_path / "w.jsonl")
    app = _app(path)
    async with app.run_test(size=(160, 45)) as pilot:
        await _ready(app, pilot)
        f = app.findings[0]
        assert f.data["blocks"][0]["stale_block"] == 6 and f.data["blocks"][0]["shared"]
        app.goto_finding(0)  # (the rule's finding: "f" would move on to the KV invariant's of the same write)
        await pilot.pause()
        text = app.query_one("#pane-window").text
        assert "writes block 6 (left in the row by old), held by a, b (shared prefix-cache block)" in _flat(text)
        # positions are listed per block index: 16-19 in index 1 (the pane's head lists the request's findings, the
        # KV invariant's among them, whose title names the positions past the request's blocks)
        assert "positions 16-19" not in "\n".join(x for x in text.splitlines() if "not its own" not in x)
        assert "16-31" in text and "16-19" in text


# ------------------------------------------------------------------------------ layout
@pytest.mark.asyncio
async def test_side_panel_collapses_under_100_columns_and_s_toggles_it():
    app = _app(SAMPLES / "stale_read_rowmoves_buggy.jsonl")
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        left, verdict = app.query_one("#left"), app.query_one("#verdict")
        assert not left.display and verdict.display
        assert app.query_one("TabbedContent").get_tab("acc").label.plain == "2 Acc"
        # it opened on the first root cause's finding: the verdict line names it
        assert "stale acc read" in str(verdict.render()) and app.findings[0].req in str(verdict.render())
        await pilot.press("s")
        await pilot.pause()
        assert left.display and not verdict.display
        await pilot.press("s")
        await pilot.pause()
        assert not left.display
        await pilot.resize_terminal(200, 50)
        await pilot.pause()
        assert left.display and not verdict.display  # crossing the breakpoint: back to the default
        assert app.query_one("TabbedContent").get_tab("acc").label.plain == "2 Accepted counts"


@pytest.mark.asyncio
async def test_wide_block_map_scrolls_sideways_in_a_narrow_pane():
    app = _app(SAMPLES / "lookahead_aligned16_k1_buggy.jsonl")
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        await pilot.press("f", "s")  # side panel on: the pane is ~44 columns, the P | D table 52
        await pilot.pause()
        pane = app.query_one("#pane-blocks")
        assert pane.max_scroll_x > 0
        pane.scroll_to(x=pane.max_scroll_x, animate=False)
        await pilot.pause()
        assert pane.scroll_x == pane.max_scroll_x > 0


# ------------------------------------------------------------------------------ findings list
@pytest.mark.asyncio
async def test_findings_one_line_each_grouped_with_coverage_per_class():
    path = SAMPLES / "lookahead_aligned16_k1_buggy.jsonl"
    app = _app(path)
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        opts = _options(app.query_one(FindingsList))
        finding_opts = [o for o in opts if o.id.startswith("f")]
        assert len(finding_opts) == len(app.findings) == 2  # the rule's and the KV invariant's (one cause: check)
        assert all("\n" not in str(o.prompt) for o in finding_opts)
        # every class has a header; a class without findings shows coverage()'s verdict
        idx = TraceIndex(str(path))
        for _ in idx.scan():
            pass
        events = list(idx.iter_events())
        cov = coverage(events, header=idx.header, footer=idx.footer)
        ids = [o.id for o in opts]
        for kind, c in cov.items():
            assert f"h:{kind}" in ids
            if kind not in ("lookahead-block-misalignment", "kv-invariant"):  # (the classes with findings)
                line = " ".join(str(next(o for o in opts if o.id == f"c:{kind}").prompt).split())
                assert " ".join(c.line().split())[:40] in line
        assert any(c.status == "not-checked" for c in cov.values())  # the sample has unchecked classes
        # grouped by request: headers are requests
        await pilot.press("g")
        await pilot.pause()
        heads = [o.id for o in _options(app.query_one(FindingsList)) if o.id.startswith("h:")]
        assert heads == [f"h:{f.req}" for f in app.findings]  # P's request (the rule's), D's (the invariant's)


@pytest.mark.asyncio
async def test_requests_listed_p_then_its_d_partner():
    app = _app(SAMPLES / "stale_read_rowmoves_buggy.jsonl")
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        rows = [str(o.prompt) for o in _options(app.query_one(RequestList))]
        for d, p in app.index.remote_req.items():
            kp = next(i for i, r in enumerate(rows) if r.strip("● ").startswith(p + " "))
            assert rows[kp + 1].strip("● ").startswith(f"└ {d} ")


@pytest.mark.asyncio
async def test_n_and_N_step_through_the_selected_requests_steps(tmp_path):
    # request a has events at steps 1 and 3 only (its step-2 truth event removed); b at 1, 2, 3
    events = [e for e in stale_events() if not (e["ev"] == "acc.truth" and e.get("req") == "a")]
    path = str(tmp_path / "s.jsonl")
    write_trace(path, make_header(origin="scenario", versions={}), events)
    app = _app(path)
    async with app.run_test(size=(150, 50)) as pilot:
        await _ready(app, pilot)
        assert app.query_one("StepScrubber").steps == [1, 2, 3]
        assert selection.request_steps(app.index, "a") == [1, 3]
        app.goto_request("a")
        app.goto_step(1)
        await pilot.press("n")
        assert app.step == 3  # step 2 has no event of a
        await pilot.press("n")
        assert app.step == 3  # none later
        await pilot.press("N")
        assert app.step == 1
        app.goto_request("b")
        await pilot.press("n")
        assert app.step == 2
        assert app.query_one("StepScrubber").req_steps == [1, 2, 3]


# ------------------------------------------------------------------------------ kept keys, export
@pytest.mark.asyncio
async def test_f_pressed_while_detectors_run_is_kept(tmp_path):
    gate = threading.Event()

    def slow_detect(events, header=None):
        gate.wait(30)
        return run_all(events, header=header)

    app = PdtraceViewer(TraceIndex(_trace(tmp_path, "stale")), detect=slow_detect)
    async with app.run_test(size=(150, 50)) as pilot:
        await pilot.pause(0.2)
        assert not app.findings_done
        await pilot.press("f")
        await pilot.pause()
        assert app.finding is None
        gate.set()
        await _ready(app, pilot)
        await pilot.pause()
        first = app.findings[0]
        assert app.finding is first and (app.req, app.step) == (first.req, first.step)
        assert app.query_one("TabbedContent").active == "acc"


@pytest.mark.asyncio
async def test_copy_finding_markdown_and_save_svg(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    app = PdtraceViewer(TraceIndex(str(SAMPLES / "stale_read_rowmoves_buggy.jsonl")), export_dir=str(out))
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        await pilot.press("c")  # (it opened on the first root cause's finding)
        await pilot.pause()
        f = app.findings[0]
        md_files = list(out.glob("*.md"))
        assert len(md_files) == 1
        md = md_files[0].read_text()
        assert md == app.clipboard
        assert md.startswith(f"### {f.kind} (error)") and f"**{f.title}**" in md
        assert f"- request: `{f.req}`, step: {f.step}, instance: `{f.inst}`" in md
        assert "trace: `stale_read_rowmoves_buggy.jsonl`" in md and f.explanation in md
        await pilot.press("S")
        await pilot.pause()
        svgs = list(out.glob("*.svg"))
        assert len(svgs) == 1 and svgs[0].read_text().lstrip().startswith("<svg")


@pytest.mark.asyncio
async def test_hiding_the_side_panel_moves_focus_so_keys_still_work():
    app = _app(SAMPLES / "stale_read_rowmoves_buggy.jsonl")
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        app.query_one(FindingsList).focus()
        await pilot.press("s")
        await pilot.pause()
        assert not app.query_one("#left").display
        assert app.focused is app.query_one(f"#pane-{app.query_one('TabbedContent').active}")
        await pilot.press("4")
        await pilot.pause()
        assert app.query_one("TabbedContent").active == "window"


@pytest.mark.asyncio
async def test_narrow_screen_of_a_clean_trace_shows_a_request_without_the_list():
    app = _app(SAMPLES / "lookahead_aligned16_k1_fixed.jsonl")
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        assert app.findings == [] and not app.query_one("#left").display
        assert app.req is not None
        text = app.query_one("#pane-blocks").text
        assert "Request P:" in text and "all local<-remote pairs hold the same tokens" in text
        assert "no findings" in str(app.query_one("#verdict").render())


@pytest.mark.asyncio
async def test_a_pane_that_cannot_be_drawn_is_reported_not_fatal(monkeypatch):
    from pdtrace.viewers.tui import drafter

    def broken(*a, **k):
        raise TypeError("'<' not supported between instances of 'str' and 'int'")

    monkeypatch.setattr(drafter, "windows", broken)
    app = _app(SAMPLES / "dflash_window_buggy.jsonl")
    async with app.run_test(size=(120, 40)) as pilot:
        await _ready(app, pilot)
        await pilot.press("f")
        await pilot.pause()
        assert app.is_running and app.query_one("TabbedContent").active == "window"
        notes = [n.message for n in app._notifications]
        assert any("cannot draw the window pane here: TypeError" in m for m in notes), notes
        await pilot.press("5")  # the other panes still work
        await pilot.pause()
        assert "cited by the finding" in app.query_one("#pane-raw").text


def test_block_map_header_fits_80_columns_with_vllms_long_request_ids():
    """vLLM's request ids (cmpl-<16 hex>-0-<8 hex>, as in the live GPU samples) overflowed an
    80-column block map header; they now go one per line, cut in the middle with an ellipsis."""
    import dataclasses

    from rich.text import Text

    from pdtrace.viewers.tui.model import BlockMap
    from pdtrace.viewers.tui.widgets.panes import BlockMapPane

    bm = BlockMap(p_req="cmpl-8686945f13fce943-0-81f7aa1a-prefill-side-id", d_req="cmpl-8686945f13fce943-0-81f7aa1a",
                  remote_num_tokens=32, prompt_len=32, groups=[], source="nixl.read", event_ids=[])
    t = Text()
    BlockMapPane._pairs(t, 40, bm)
    lines = t.plain.splitlines()
    assert all(len(ln) <= 40 for ln in lines[:2]), lines
    assert "…" in lines[0] and lines[1].startswith("    ->  D:cmpl-")
    short = dataclasses.replace(bm, p_req="req-1-P", d_req="req-1-D")
    t = Text()
    BlockMapPane._pairs(t, 80, short)
    assert t.plain.splitlines()[0] == "Request P:req-1-P  ->  D:req-1-D"


@pytest.mark.asyncio
async def test_a_block_map_with_nothing_to_draw_says_where_the_requests_findings_are():
    """A new user's pass (2026-11-27): the live #51571 trace opened on an empty Block map ("No NIXL block
    events") with nothing saying that the first request's findings were in the Acc tab."""
    app = _app(SAMPLES / "live_gpu_race51571_v1_bug.jsonl.zst")
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        text = app.query_one("#pane-blocks").text
        assert "No NIXL block events for request" in text and "Its findings are in tab 2 Acc" in text


@pytest.mark.asyncio
async def test_f_goes_through_the_findings_by_their_numbers_whatever_the_grouping(tmp_path):
    """A new user's pass (issue 39): the list groups findings by class, and `f` went in list order, so
    the "n/22" label jumped 1, 4, 5, 6, 16, 2, ... `f` now goes 1, 2, 3 as `check` numbers them
    (``by_severity``), grouped by class or by request, and `F` back. Trace: bench/gen_trace.py's,
    with every bug class injected (findings of five classes interleaved in check's order)."""
    from pdtrace.viewers.tui.app import PdtraceViewer

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
    from gen_trace import generate

    path = tmp_path / "g.jsonl"
    generate(str(path), 8_000, seed=0)
    app = PdtraceViewer(TraceIndex(str(path)))
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(500):
            if app.findings_done:
                break
            await pilot.pause(0.02)
        n = len(app.findings)
        kinds = [f.kind for f in app.findings]
        assert n >= 10 and len(set(kinds)) >= 4 and kinds != sorted(kinds, key=kinds.index)  # interleaved
        for group in ("class", "request"):
            if app.group_by != group:
                await pilot.press("g")
                await pilot.pause()
            seen = []
            for _ in range(n):
                await pilot.press("f")
                await pilot.pause()
                seen.append(app.findings.index(app.finding))
            start = seen[0]
            assert seen == [(start + i) % n for i in range(n)], (group, seen)
            await pilot.press("F")
            await pilot.pause()
            assert app.findings.index(app.finding) == (seen[-1] - 1) % n


def test_request_list_pairs_a_d_request_that_lost_its_params_with_its_p():
    """Issue 51: a D request that arrived without transfer params names no P request (no remote_request_id, no
    NIXL read), so the request list showed it alone; kv-never-crossed matched it to P's by the prompt, and the list
    puts it under that P request. The sample's provenance says which two lost their params (cross-1, cross-4)."""
    from pdtrace.commands.view import open_source
    from pdtrace.viewers.tui import selection

    idx = open_source(str(pathlib.Path(__file__).parent.parent / "sample_traces"
                          / "kv_never_crossed_dropped_params_buggy.jsonl"))
    idx.build()
    fs = run_all(list(idx.iter_events()), header=idx.header)
    matched = selection.matched_pairs(fs)
    assert matched == {"cross-1-D": "cross-1-P", "cross-4-D": "cross-4-P"}
    before = selection.request_rows(idx, {f.req for f in fs})
    rows = selection.request_rows(idx, {f.req for f in fs}, "", matched)
    assert ("cross-1-D", "D", True, 0) in before  # alone before
    at = [r[0] for r in rows]
    for d, p in matched.items():
        assert at[at.index(p) + 1] == d and rows[at.index(d)][3] == 1
        assert rows[at.index(d)][1] == "D  no params: matched by prompt"
    assert ("cross-6-D", "D", False, 0) in rows  # sent to D alone: no P request of its prompt
    assert len(rows) == len(before)
