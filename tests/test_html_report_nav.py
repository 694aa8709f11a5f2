"""The HTML report as something to navigate (issue 21): the summary's counts, the event
table every cited id links to, the findings' time ranges, captions whose colour words match
the traces, and, in headless Chromium, a click on a finding (the page's ``?autoclick=K``
hook) zooming every time-axis figure and listing the cited events.

Findings come from the real detectors (``pdtrace.detectors.run_all``) on the bundled
samples; nothing here imports vLLM.
"""

from __future__ import annotations

import collections
import html
import html.parser
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

from pdtrace.commands import report as report_cmd  # noqa: E402
from pdtrace.detectors import by_severity, run_all  # noqa: E402
from pdtrace.tracefile.trace import load  # noqa: E402
from pdtrace.viewers.html import common, report, summary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"
BUGGY = sorted(SAMPLES.glob("*_buggy.jsonl")) + [ROOT / "pdtrace" / "samples" / "demo_lookahead_misalignment.jsonl"]
ALL_SAMPLES = sorted(SAMPLES.glob("*.jsonl")) + sorted((ROOT / "pdtrace" / "samples").glob("*.jsonl"))


def _render(path: Path, **kw):
    tr = load(str(path))
    findings = by_severity(run_all(tr.events, header=tr.header))  # the order the page numbers them in
    page, stats = report.render(tr, findings, **kw)
    return tr, findings, page, report.unpack_data(page), stats


def _section(page: str, sec_id: str) -> str:
    start = page.index(f'<section id="{sec_id}">')
    return page[start:page.index("</section>", start)]


def _xs(tr, ids) -> list[float]:
    m = common.Model(tr.events, [])
    by_id = {e.get("id", i): e for i, e in enumerate(tr.events)}
    return [m.x(by_id[i]) for i in ids if i in by_id]


# ------------------------------------------------------------------------------ structure

def test_buggy_samples_are_there():
    assert len(BUGGY) >= 5 and all(p.exists() for p in BUGGY)


@pytest.mark.parametrize("path", BUGGY, ids=lambda p: p.stem)
def test_every_cited_event_is_linked_and_in_the_table(path):
    tr, findings, page, data, _ = _render(path)
    assert findings, f"{path.name} should give the detectors something to find"
    embedded = [r[0] for r in data["events"]["rows"]]
    assert embedded == sorted(set(embedded)), "the table is in id order, one row per event"
    cited = {i for f in findings for i in f.event_ids}
    assert cited <= set(embedded)
    # every #ev-N link on the page points at an embedded row
    linked = {int(n) for n in re.findall(r'href="#ev-(\d+)"', page)}
    assert linked <= set(embedded)
    rows = page.split('<tr id="finding-')[1:]
    assert len(rows) == len(findings)
    for k, (f, row) in enumerate(zip(findings, rows)):
        assert row.startswith(f'{k + 1}" class="finding {f.severity}" data-finding="{k}"')  # #finding-N: the # column
        fev = row[row.index("<td class='fev'>"):row.index("</tr>")]
        assert [int(n) for n in re.findall(r'data-ev="(\d+)"', fev)] == f.event_ids[:summary.MAX_LINKED_IDS]
        # the page's data for the click: the cited ids and a time range that covers them
        fd = data["findings"][k]
        assert fd["ids"] == f.event_ids and fd["kind"] == f.kind
        xs = _xs(tr, f.event_ids)
        assert fd["x"][0] <= min(xs) and max(xs) <= fd["x"][1]


@pytest.mark.parametrize("path", BUGGY, ids=lambda p: p.stem)
def test_summary_counts_equal_the_detectors(path):
    from pdtrace.detectors.coverage import coverage

    tr, findings, page, _, _ = _render(path)
    top = _section(page, "overview")
    n_err = sum(f.severity == "error" for f in findings)
    assert f"<b>{len(findings)} finding(s)</b>: {n_err} error(s), {len(findings) - n_err} warning(s)" in top
    # per class: the coverage verdict (the same line `check` prints) and the number of findings
    per_class = collections.Counter(f.kind for f in findings)
    cov = coverage(tr.events, tr.header, tr.footer)
    for kind, c in cov.items():
        line = html.escape(c.line())  # (the page escapes it: "D's workers" in the KV invariant's reason)
        m = re.search(rf"<td>{re.escape(kind)}</td><td>{re.escape(line)}</td><td>(.*?)</td></tr>", top)
        assert m, kind
        got = re.search(r"<b>(\d+)</b>", m.group(1))
        if per_class[kind]:
            assert got and int(got.group(1)) == per_class[kind], kind
        else:
            assert got is None, kind
    # per request
    per_req = collections.Counter(f.req or "(no request)" for f in findings)
    table = top[top.index("<h3>Findings per request</h3>"):]
    got_req = {re.sub(r"<[^>]+>|\s*\(pair .*", "", name).strip(): int(n) for name, n in
               re.findall(r"<tr><td>(.*?)</td><td><a class=\"selfind\"[^>]*><b>(\d+)</b>", table)}
    assert got_req == dict(per_req)


def test_no_findings_keeps_the_not_checked_line():
    tr, findings, page, data, _ = _render(SAMPLES / "dflash_window_fixed.jsonl")
    assert not findings and data["findings"] == []
    assert "No findings in the classes checked; 1 class(es) not checked" in _section(page, "overview")
    assert "range" not in data["figs"]["fig-timeline"]["layout"]["xaxis"]  # whole trace when nothing to show


def test_timeline_opens_on_the_findings():
    """The metadata sample's findings sit at ~645.6 ms after 0.15 ms of work, most events near
    0-7 ms: the timeline must open on the findings, not squeeze them into one pixel column."""
    tr, findings, page, data, _ = _render(SAMPLES / "metadata_cleared_before_drafter_buggy.jsonl")
    rng = data["figs"]["fig-timeline"]["layout"]["xaxis"]["range"]
    xs = _xs(tr, [i for f in findings for i in f.event_ids])
    assert rng[0] <= min(xs) and max(xs) <= rng[1]
    assert rng[1] - rng[0] < 1.0 < max(_xs(tr, [e["id"] for e in tr.events]))
    assert rng == [min(f["x"][0] for f in data["findings"]), max(f["x"][1] for f in data["findings"])]
    assert "opens on the findings' time range" in _section(page, "timeline")


def test_time_axis_figures_are_the_ones_zoomed(tmp_path):
    _, _, _, data, _ = _render(Path(bc.write_buggy_trace(tmp_path / "buggy.jsonl")))
    want = {f for f in data["figs"] if f == "fig-timeline" or f.startswith(("fig-accepted-", "fig-metadata-"))}
    assert set(data["timefigs"]) == want and len(want) >= 3
    for fid in data["figs"]:
        title = data["figs"][fid]["layout"].get("xaxis", {}).get("title", {}).get("text", "")
        assert (fid in want) == title.startswith("time (ms"), fid


def test_caption_colour_words_match_the_traces(tmp_path):
    """Every swatch in a caption names a trace drawn in that section and a colour that trace
    draws with, and its word is that colour's (no 'Blue bars' over a pink swatch)."""
    pages = [_render(Path(bc.write_buggy_trace(tmp_path / "b.jsonl"))),
             _render(SAMPLES / "dflash_window_buggy.jsonl"), _render(SAMPLES / "stale_read_rowmoves_buggy.jsonl")]
    fig_prefix = {"timeline": "fig-timeline", "blockmaps": "fig-blockmap-", "accepted": "fig-accepted-",
                  "metadata": "fig-metadata-", "windows": "fig-windows"}
    seen = collections.Counter()
    for _, _, page, data, _ in pages:
        for sec, prefix in fig_prefix.items():
            if f'<section id="{sec}">' not in page:
                continue
            body = _section(page, sec)
            traces = [t for k, f in data["figs"].items() if k.startswith(prefix) for t in f["data"]]
            for colour, name, word in re.findall(
                    r'data-color="(#[0-9a-f]{6})" data-trace="([^"]*)"[^>]*></span><span class="swname">([^<]+)<', body):
                name = html.unescape(name)
                assert word == common.COLOR_WORDS[colour]
                assert any(t["name"].startswith(name) and colour in common.trace_colours(t) for t in traces), \
                    (sec, name, colour, word)
                seen[sec] += 1
            # no colour named by hand: every colour word sits in a swatch
            text = re.sub(r"<[^>]+>", " ", re.sub(r'<span class="swname">[^<]*</span>', "", body))
            for word in ("blue", "pink", "green", "orange", "purple"):
                assert not re.search(rf"\b{word}\b", text, re.I), (sec, word)
    assert set(fig_prefix) <= set(seen)
    # the "engine steps" legend entry is never the finding-step colour, and the caption says so
    tl = pages[0][3]["figs"]["fig-timeline"]["data"]
    steps = next(t for t in tl if t["name"] == "engine steps")
    bad = next(t for t in tl if t["name"] == "engine step a finding names")
    assert set(steps["marker"]["color"]) <= set(common.STEP_BAR)
    assert set(bad["marker"]["color"]) == {common.STEP_BAR_FINDING}
    assert (f'{common.swatch(common.STEP_BAR[0], trace="engine steps")} bars: engine steps'
            in _section(pages[0][2], "timeline"))


def test_event_table_is_trimmed_around_findings_and_says_so(tmp_path):
    tr = load(bc.write_large_trace(tmp_path / "large.jsonl", 6000))
    findings = run_all(tr.events, header=tr.header)
    page, stats = report.render(tr, findings, event_cap=1000)
    data = report.unpack_data(page)
    ev = data["events"]
    assert ev["total"] == len(tr.events) and ev["embedded"] == len(ev["rows"]) == 1000
    assert stats["events_trimmed"] == len(tr.events) - 1000
    assert {i for f in findings for i in f.event_ids} <= {r[0] for r in ev["rows"]}
    assert f"1,000 of {len(tr.events):,} events are embedded" in _section(page, "events")


def test_many_findings_stay_within_the_size_bound(tmp_path):
    """A deployment buggy at every step can give thousands of findings: the page lists the
    first MAX_FINDING_ROWS (their cited events embedded), counts all of them and stays small."""
    tr = load(bc.write_large_trace(tmp_path / "many.jsonl", 60_000))
    reads = [e for e in tr.events if e["ev"] == "acc.read"]
    n = 5000
    findings = [{"kind": "stale-accepted-count-read", "severity": "error", "req": e.get("req"), "step": e.get("step"),
                 "inst": e.get("inst"), "event_ids": [e["id"] - 2, e["id"] - 1, e["id"]],
                 "title": f"synthetic finding {k} on {e.get('req')}", "explanation": "x " * 200, "data": {"k": k}}
                for k, e in zip(range(n), reads * (n // len(reads) + 1))]
    page, stats = report.render(tr, findings)
    assert stats["bytes"] < report.MAX_BYTES
    data = report.unpack_data(page)
    listed = summary.MAX_FINDING_ROWS
    assert len(data["findings"]) == listed == len(page.split('<tr id="finding-')) - 1
    assert f"The first {listed:,} of {n:,} findings are listed" in page
    assert f"<b>{n} finding(s)</b>" in _section(page, "overview")
    embedded = {r[0] for r in data["events"]["rows"]}
    assert {i for f in findings[:listed] for i in f["event_ids"]} <= embedded
    assert {int(i) for i in re.findall(r'data-finding="(\d+)"', page)} <= set(range(listed))


def test_report_sizes_on_the_samples(tmp_path):
    """Every bundled sample, the largest included, stays under the 5 MB bound."""
    largest = max(ALL_SAMPLES, key=lambda p: p.stat().st_size)
    for path in ALL_SAMPLES:
        out = tmp_path / (path.stem + ".html")
        assert report_cmd.run(path, out, lenient=False) == 0
        size = out.stat().st_size
        assert size < report.MAX_BYTES, f"{path.name}: {size} bytes"
        if path == largest:
            data = report.unpack_data(out.read_text(encoding="utf-8"))
            assert data["events"]["trimmed"] == 0  # the live sample fits whole


def test_report_modules_stay_small():
    for f in (ROOT / "viewers" / "html").glob("*.py"):
        n = len(f.read_text().splitlines())
        assert n <= 400, f"{f.name}: {n} lines"


# ------------------------------------------------------------------------------ in Chromium

class _Dom(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.body: dict = {}
        self.ev_rows: list[dict] = []
        self.raw_sel: str | None = None

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        if tag == "body":
            self.body = a
        if "id" in a:
            self.by_id[a["id"]] = {"tag": tag, **a}
        if tag == "tr" and "data-ev" in a:
            self.ev_rows.append(a)
        if tag == "span" and a.get("id") == "pd-sel-figs":
            self._in_sel = True
        elif getattr(self, "_in_sel", False) and tag == "a":
            self.raw_sel = (self.raw_sel or "") + f'href="{a.get("href", "")}" '

    def handle_endtag(self, tag):
        if tag == "span":
            self._in_sel = False


def _dom(text: str) -> _Dom:
    d = _Dom()
    d.feed(text)
    d.close()
    return d


def _xrange(d: _Dom, fid: str) -> tuple[float, float]:
    lo, hi = d.by_id[fid]["data-xrange"].split(",")
    return float(lo), float(hi)


@pytest.fixture(scope="module")
def stale_page(tmp_path_factory):
    out = tmp_path_factory.mktemp("nav") / "stale.html"
    trace = SAMPLES / "stale_read_rowmoves_buggy.jsonl"
    assert report_cmd.run(trace, out, lenient=False) == 0
    tr = load(str(trace))
    return out, report.unpack_data(out.read_text(encoding="utf-8")), by_severity(run_all(tr.events, header=tr.header))


@pytest.mark.browser
@pytest.mark.skipif(bc.find_chromium() is None,
                    reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_clicking_a_finding_zooms_every_time_figure_and_lists_its_events(stale_page, tmp_path):
    html_path, data, findings = stale_page
    k = 2
    f = findings[k]
    before = _dom(bc.render_with_chromium(html_path))
    shot = tmp_path / "report_finding.png"
    after = _dom(bc.render_with_chromium(html_path, query=f"?autoclick={k}", screenshot=shot, window="1400,2800"))
    for d in (before, after):
        assert "data-pd-error" not in d.body and int(d.body["data-pd-rendered"]) == len(data["figs"])
    assert after.body.get("data-pd-clicked") == str(k) and after.body.get("data-selected-finding") == str(k)
    assert "sel" in after.by_id[f"finding-{k + 1}"]["class"].split()
    want = data["findings"][k]["x"]
    assert len(data["timefigs"]) >= 2
    for fid in data["timefigs"]:
        lo, hi = _xrange(after, fid)
        assert abs(lo - want[0]) < 1e-3 and abs(hi - want[1]) < 1e-3, (fid, (lo, hi), want)
        assert _xrange(before, fid) != (lo, hi), f"{fid} did not move"
    # the table lists exactly the cited events, every one highlighted
    listed = [int(r["data-ev"]) for r in after.ev_rows]
    assert sorted(listed) == sorted(f.event_ids)
    assert all(r.get("data-highlighted") == "1" for r in after.ev_rows)
    assert "hidden" not in after.by_id["pd-ev-banner"]  # "listing the events cited by finding k+1"
    # the selected finding's crosses are marked (selectedpoints), by event id, in every figure drawing crosses
    for fid, fig in data["figs"].items():
        crosses = [c for tr in fig["data"] if tr.get("name") == "finding" for c in tr.get("customdata") or ()]
        if crosses:
            assert after.by_id[fid].get("data-marked") == str(sum(c in f.event_ids for c in crosses)), fid
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("PDTRACE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report_finding.png")


@pytest.mark.browser
@pytest.mark.skipif(bc.find_chromium() is None,
                    reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_a_cited_id_opens_the_event_among_all_events(stale_page):
    html_path, data, findings = stale_page
    n = findings[0].event_ids[-1]
    d = _dom(bc.render_with_chromium(html_path, query=f"?ev={n}"))
    assert d.body.get("data-pd-focus") == str(n)
    row = d.by_id[f"ev-{n}"]
    assert row.get("data-focus") == "1" and row.get("data-highlighted") == "1"
    ids = [int(r["data-ev"]) for r in d.ev_rows]
    assert n - 1 in ids and n + 1 in ids, "shown in context, not alone"


@pytest.mark.browser
@pytest.mark.skipif(bc.find_chromium() is None,
                    reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_the_timeline_opens_on_the_findings_in_chromium(tmp_path):
    trace = SAMPLES / "metadata_cleared_before_drafter_buggy.jsonl"
    out = tmp_path / "meta.html"
    assert report_cmd.run(trace, out, lenient=False) == 0
    data = report.unpack_data(out.read_text(encoding="utf-8"))
    d = _dom(bc.render_with_chromium(out))
    lo, hi = _xrange(d, "fig-timeline")
    want = data["figs"]["fig-timeline"]["layout"]["xaxis"]["range"]
    assert abs(lo - want[0]) < 1e-3 and abs(hi - want[1]) < 1e-3 and hi - lo < 1.0


@pytest.mark.browser
@pytest.mark.skipif(bc.find_chromium() is None,
                    reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_clicking_an_event_row_zooms_the_time_figures_to_it(stale_page):
    """A real click (dispatched on the row's cell, so the page's own handler runs) on an
    event the selected finding does not cite: every time axis centres on that event."""
    html_path, data, findings = stale_page
    k = 0
    rows = {r[0]: r for r in data["events"]["rows"]}
    n = next(i for i in sorted(rows) if i not in findings[k].event_ids and i > findings[k].event_ids[0])
    d = _dom(bc.render_with_chromium(html_path, query=f"?autoclick={k}&clickev={n}"))
    assert d.body.get("data-pd-evclicked") == str(n) and d.body.get("data-pd-zoomed-event") == str(n)
    assert d.by_id[f"ev-{n}"].get("data-focus") == "1"
    t = rows[n][1]
    for fid in data["timefigs"]:
        lo, hi = _xrange(d, fid)
        assert lo < t < hi and abs((lo + hi) / 2 - t) < 1e-2, (fid, lo, hi, t)


@pytest.mark.browser
@pytest.mark.skipif(bc.find_chromium() is None,
                    reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_a_finding_outlines_its_block_map_and_zooms_the_window_figure(tmp_path):
    for name, fid in (("lookahead_aligned16_k1_buggy.jsonl", "fig-blockmap-0"), ("dflash_window_buggy.jsonl", "fig-windows")):
        out = tmp_path / (name + ".html")
        assert report_cmd.run(SAMPLES / name, out, lenient=False) == 0
        data = report.unpack_data(out.read_text(encoding="utf-8"))
        before = _dom(bc.render_with_chromium(out))
        d = _dom(bc.render_with_chromium(out, query="?autoclick=0"))
        assert d.body.get("data-pd-clicked") == "0"
        assert before.by_id[fid].get("data-selected") is None and d.by_id[fid].get("data-selected") == "1", name
        assert f'href="#{fid}"' in (d.raw_sel or ""), name
        if fid == "fig-blockmap-0":
            assert set(data["findings"][0]["reqs"]) & set(data["reqfigs"][fid])


@pytest.mark.browser
@pytest.mark.skipif(bc.find_chromium() is None,
                    reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_a_finding_anchor_in_the_url_selects_the_row_numbered_so(stale_page):
    """Issue 39: `#finding-N` names the finding the # column numbers N (from 1, as check does), so a
    link cited in a bug report opens that row, not the next one."""
    html_path, data, findings = stale_page
    assert len(findings) >= 2
    d = _dom(bc.render_with_chromium(html_path, query="#finding-2"))
    assert d.body.get("data-selected-finding") == "1"
    row = d.by_id["finding-2"]
    assert "sel" in row["class"].split() and row["data-finding"] == "1"


def test_only_trace_event_references_are_linked():
    """A finding's 'local #0' (a block position) and 'vLLM #44151' are not events."""
    text = summary._linkify("local #0 (block 2) <- P block 3; trace event 107; event #9; vLLM #44151", lambda i: True)
    assert re.findall(r'data-ev="(\d+)"', text) == ["107", "9"]
    assert "local #0" in text and "#44151" in text
