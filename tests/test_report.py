"""`pdtrace report`: the self-contained HTML report.

Traces are small schema-valid traces written with ``pdtrace.tracefile.trace.write_trace``
(tests/browser_check.py), findings come from the real detectors (``pdtrace.detectors``).
"""

from __future__ import annotations

import base64
import gzip
import html.parser
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

from pdtrace.commands import report as report_cmd  # noqa: E402
from pdtrace.tracefile.trace import load  # noqa: E402
from pdtrace.viewers.html import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class _Parser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, dict] = {}
        self.scripts: list[dict] = []
        self.external: list[str] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids[a["id"]] = {"tag": tag, **a}
        if tag == "script":
            self.scripts.append(a)
            if a.get("src"):
                self.external.append(a["src"])
        if tag == "link" and a.get("href"):
            self.external.append(a["href"])


def _parse(page: str) -> _Parser:
    p = _Parser()
    p.feed(page)
    p.close()
    return p


@pytest.fixture(scope="module")
def buggy(tmp_path_factory) -> Path:
    return Path(bc.write_buggy_trace(tmp_path_factory.mktemp("rep") / "buggy.jsonl"))


@pytest.fixture(scope="module")
def page(buggy, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("rep-out") / "report.html"
    assert report_cmd.run(buggy, out, lenient=False) == 0
    return out.read_text(encoding="utf-8")


def test_report_parses_and_has_plot_divs(page):
    p = _parse(page)
    figs = {i for i, a in p.ids.items() if "pdfig" in a.get("class", "")}
    assert "fig-timeline" in figs
    assert any(f.startswith("fig-blockmap-") for f in figs)
    assert any(f.startswith("fig-accepted-") for f in figs)
    assert any(f.startswith("fig-metadata-") for f in figs)
    # every div has its figure in the embedded data, and nothing else is there
    data = report.unpack_data(page)
    assert set(data["figs"]) == figs
    for fig in data["figs"].values():
        assert fig["data"], "a figure without traces"


def test_report_is_self_contained(page):
    p = _parse(page)
    assert p.external == [], f"external resources: {p.external}"
    assert "cdn.plot.ly" not in page and "https://cdn" not in page
    # plotly.js is embedded (gzip + base64) and unpacks to the installed plotly bundle
    start = page.index('<script id="pd-plotly" type="application/octet-stream">') + len(
        '<script id="pd-plotly" type="application/octet-stream">')
    js = gzip.decompress(base64.b64decode(page[start:page.index("</script>", start)].strip()))
    spec = importlib.util.find_spec("plotly")
    installed = (Path(spec.origin).parent / "package_data" / "plotly.min.js").read_bytes()
    assert js == installed


def test_report_findings_and_figures_follow_the_trace(page, buggy):
    from pdtrace.detectors import run_all

    tr = load(str(buggy))
    findings = run_all(tr.events, header=tr.header)
    assert findings, "the buggy trace should give the detectors something to find"
    for f in findings:
        assert f.kind in page  # findings table lists every finding kind
    data = report.unpack_data(page)
    # block map: D block 5 paired with P block 11 where P block 10 was expected -> a mismatch trace point
    bm = [f for k, f in data["figs"].items() if k.startswith("fig-blockmap-")]
    assert len(bm) == 1, "only the misaligned request (d-r1) is affected"
    names = {t["name"]: t for t in bm[0]["data"]}
    actual = next(t for n, t in names.items() if n.startswith("actual pairing"))
    assert actual["y"] == [11] and actual["marker"]["color"] == [report._RED]
    lookahead = next(t for n, t in names.items() if n.startswith("P lookahead block"))
    assert lookahead["y"] == [11]
    expected = next(t for n, t in names.items() if n.startswith("expected P block"))
    assert expected["y"] == [10]
    # accepted counts: the stale reads cited by the detector are drawn as stale reads
    acc = data["figs"]["fig-accepted-0"]
    stale = [t for t in acc["data"] if t["name"] == "stale read (finding)"]
    stale_finds = [f for f in findings if f.kind == "stale-accepted-count-read"]
    assert stale_finds and stale and len(stale[0]["x"]) == len({i for f in stale_finds for i in f.event_ids
                                                                if tr.events[i]["ev"] == "acc.read"})
    # metadata: the P worker's drafter began after the clear
    meta = [f for k, f in data["figs"].items() if k.startswith("fig-metadata-")]
    assert any(t["name"] == "drafter began after clear" for f in meta for t in f["data"])


def test_report_without_findings_says_so(tmp_path):
    tr = load(bc.write_large_trace(tmp_path / "clean.jsonl", 200))
    tr.events = [e for e in tr.events if e.get("req") not in ("d-r1", "r1")]
    page, stats = report.render(tr, [])
    assert "No findings" in page and "<h3>Coverage</h3>" in page
    assert stats["aggregated"] == 0 and "all " in page and "events are drawn one by one" in page


def _large_trace(path: Path, n: int) -> Path:
    gen = ROOT / "bench" / "gen_trace.py"
    if gen.exists():
        spec = importlib.util.spec_from_file_location("gen_trace", gen)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if hasattr(mod, "generate"):
            mod.generate(str(path), n, seed=0, inject_bugs=True)
            return path
    bc.write_large_trace(path, n)
    return path


def test_report_size_bound_on_large_trace(tmp_path):
    trace = _large_trace(tmp_path / "large.jsonl", 200_000)
    out = tmp_path / "large.html"
    assert report_cmd.run(trace, out, lenient=False) == 0
    size = out.stat().st_size
    assert size < report.MAX_BYTES, f"report is {size} bytes"
    page = out.read_text(encoding="utf-8")
    assert "aggregated into" in page  # the page says what it aggregated
    p = _parse(page)
    assert "fig-timeline" in p.ids
    data = report.unpack_data(page)
    tl = data["figs"]["fig-timeline"]
    agg = [t for t in tl["data"] if t["name"].startswith("aggregated events")]
    assert agg and len(agg[0]["x"]) > 0


def test_size_bound_is_enforced_by_shrinking(buggy):
    """With a tiny byte budget the renderer lowers its point budget until it fits (or hits the floor)."""
    tr = load(bc.write_large_trace(Path(buggy).with_name("mid.jsonl"), 20_000))
    page, stats = report.render(tr, [], max_bytes=2_100_000, point_budget=30_000)
    assert stats["point_budget"] < 30_000
    assert len(page.encode()) <= 2_100_000 or stats["point_budget"] == 200


def test_report_cli_errors_on_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = subprocess.run([sys.executable, "-m", "pdtrace", "report", str(bad), "-o", str(tmp_path / "x.html")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "not a pdtrace trace" in r.stderr
    assert not (tmp_path / "x.html").exists()


def test_viewers_import_no_vllm_or_torch(buggy, tmp_path):
    code = (
        "import sys\n"
        "from pdtrace.tracefile.trace import load\n"
        "from pdtrace.viewers.html import report\n"
        "from pdtrace.viewers import perfetto\n"
        f"tr = load({str(buggy)!r})\n"
        f"report.write(tr, {str(tmp_path / 'r.html')!r}, [])\n"
        f"perfetto.write(tr, {str(tmp_path / 'p.json')!r}, [])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print('IMPORTED', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    # and no source file under viewers/ names them in an import
    for f in (ROOT / "viewers").rglob("*.py"):
        for line in f.read_text().splitlines():
            s = line.strip()
            assert not (s.startswith(("import vllm", "import torch", "from vllm", "from torch"))), f"{f}: {s}"


@pytest.mark.skipif(not (ROOT / "sample_traces").is_dir() or not any((ROOT / "sample_traces").glob("*.jsonl")),
                    reason="sample_traces/ has no traces yet")
def test_report_on_sample_traces(tmp_path):
    for trace in sorted((ROOT / "sample_traces").glob("*.jsonl")):
        out = tmp_path / (trace.stem + ".html")
        assert report_cmd.run(trace, out, lenient=False) == 0
        assert out.stat().st_size < report.MAX_BYTES
        assert "fig-timeline" in _parse(out.read_text(encoding="utf-8")).ids


def test_report_lists_coverage_and_never_calls_unchecked_clean(tmp_path):
    """The fixed DFlash sample has no drafter phase events: the report must say the metadata
    class was not checked (as `check` does), not a bare "No findings"."""
    from pdtrace.detectors.coverage import coverage

    tr = load(str(ROOT / "sample_traces" / "dflash_window_fixed.jsonl"))
    page, _ = report.render(tr, [])
    cov = coverage(tr.events, tr.header, tr.footer)
    unchecked = [k for k, c in cov.items() if c.status == "not-checked"]
    assert unchecked == ["connector-metadata-cleared-before-drafter"]
    assert "No findings in the classes checked; 1 class(es) not checked: connector-metadata-cleared-before-drafter" in page
    for k, c in cov.items():
        assert f"<td>{k}</td><td>{c.line()}" in page


@pytest.mark.parametrize("sample", ["kv_load_async_rollback_buggy", "kv_load_async_rollback_fixed"])
def test_report_draws_each_failed_kv_load(tmp_path, sample):
    """The KV-load samples: a block map per request a failed load touched (the failed block as a
    red ×, where the scheduler left its computed tokens) and the recovery as a row of the
    timeline (failed -> scheduled again -> finished, when it finished), against the trace's
    own kvload.request / req.finish events."""
    trace = ROOT / "sample_traces" / f"{sample}.jsonl"
    out = tmp_path / "r.html"
    assert report_cmd.run(trace, out, lenient=False) == 0
    page = out.read_text(encoding="utf-8")
    assert 'href="#kvload"' in page and 'id="kvload"' in page
    tr = load(str(trace))
    (dec,) = [e for e in tr.events if e["ev"] == "kvload.request"]
    handled = next(e for e in tr.events if e["ev"] == "kvload.handled" and e["step"] == dec["step"])
    data = report.unpack_data(page)
    (fig,) = [f for k, f in data["figs"].items() if k.startswith("fig-kvload-")]
    failed = next(t for t in fig["data"] if t.get("name") == "failed to load")
    blocks = dec["block_ids"][0]
    assert [blocks[x] for x in failed["x"]] == [b for b in blocks if b in handled["block_ids"]]
    assert any(t.get("hovertext") == f"computed after (restart): {dec['computed']} tokens" for t in fig["data"])
    assert dec["req"] in fig["layout"]["title"]["text"]
    rows = [t for t in data["figs"]["fig-timeline"]["data"] if t["name"].startswith("KV load recovery")]
    assert rows and rows[0]["y"][0] == f"{dec['inst']} KV load recovery"
    finished = [e for e in tr.events if e["ev"] == "req.finish" and e.get("req") == dec["req"]]
    n = 2 + bool(finished)  # failed, scheduled again, finished (the buggy sample never finishes)
    assert rows[0]["marker"]["symbol"][:n] == ["x", "circle", "square"][:n] and rows[0]["x"][n] is None
    assert any(k.startswith("fig-kvload-") and dec["req"] in v for k, v in data["reqfigs"].items())


@pytest.mark.parametrize("sample", ["kv_never_crossed_drafter_group_buggy", "kv_never_crossed_drafter_group_fixed"])
def test_report_draws_what_reached_each_kv_cache_group(tmp_path, sample):
    """Issue 51: the Prompt tokens section draws, per KV cache group, what of D's load reached it, and for each
    request whose drafter group never got its KV, D's blocks per group. Against the trace's own events: D's whole
    list at the load and the blocks its connector loads into (nixl.remote_alloc), the transfer groups (sched.config)."""
    trace = ROOT / "sample_traces" / f"{sample}.jsonl"
    out = tmp_path / "r.html"
    assert report_cmd.run(trace, out, lenient=False) == 0
    page = out.read_text(encoding="utf-8")
    data = report.unpack_data(page)
    tr = load(str(trace))
    allocs = [e for e in tr.events if e["ev"] == "nixl.remote_alloc"]
    (cfg,) = [e for e in tr.events if e["ev"] == "sched.config" and e["inst"] == "D"]
    kept = "transfer_group_ids" in cfg  # the buggy run: the drafter's group 1 is not a transfer group
    bars = {t["name"]: t for t in data["figs"]["fig-crossing-groups"]["data"]}
    loaded = sum(a["num_external_tokens"] for a in allocs)
    assert bars["loaded into the group"]["x"] == ([loaded, 0] if kept else [loaded, loaded])
    assert ("not a transfer group: counted computed, never written" in bars) == kept
    maps = sorted(k for k in data["figs"] if k.startswith("fig-crossing-req-"))
    assert len(maps) == (len(allocs) if kept else 0)
    for k, a in zip(maps, allocs):
        fig = {t["name"]: t for t in data["figs"][k]["data"]}
        assert a["req"] in data["figs"][k]["layout"]["title"]["text"]
        assert fig["loaded from P"]["text"] == [str(b) for b in a["load_block_ids"][0]]
        assert fig["counted computed, never written (not a transfer group)"]["text"] == [
            str(b) for b in a["local_block_ids"][1]]
    assert ('are drawn per KV cache group under <a href="#crossing">' in page) == kept
