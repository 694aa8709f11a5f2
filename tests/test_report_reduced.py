"""`pdtrace report` of a trace too big to hold (viewers/html/reduce.py, issue 22): the page
built from two passes (the streamed check, then the events the page can show with the
trace's counts) against the page built from the whole trace loaded.

With a small event cap and point budget, so that the whole-trace page trims too, and the
reduction's opening shrunk to match: the findings, the summary, the findings table, the
trace facts and the event table's rows are the same, and so is every figure but the
timeline's aggregated markers (whose time bins span the whole trace instead of the
aggregated events' own range). On every bundled sample (real vLLM scheduler / NIXL code,
live CPU and GPU runs, and the documented worker simulation) and a generated P/D trace
with all four bug classes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pdtrace.commands import report as report_cmd
from pdtrace.viewers.html import reduce, report

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted([*(ROOT / "sample_traces").glob("*.jsonl"), *(ROOT / "sample_traces").glob("*.jsonl.zst")])
CAP, BUDGET = 60, 80


def _section(page: str, sid: str) -> str:
    return re.sub(r"created</th><td>[^<]*", "", re.search(f'<section id="{sid}">(.*?)</section>', page, re.S).group(1))


def _pages(path: Path, monkeypatch):
    monkeypatch.setattr(reduce, "OPENING", max(CAP, BUDGET))
    tw, fw, _ = report_cmd.load_with_findings(path, False)
    pw, sw = report.render(tw, fw, event_cap=CAP, point_budget=BUDGET)
    tr, fr, _ = report_cmd.read_reduced(path, False)
    pr, sr = report.render(tr, fr, event_cap=CAP, point_budget=BUDGET)
    return tw, tr, (pw, sw, report.unpack_data(pw)), (pr, sr, report.unpack_data(pr))


def _same_pages(path: Path, monkeypatch):
    tw, tr, (pw, sw, dw), (pr, sr, dr) = _pages(path, monkeypatch)
    assert tr.totals.n == len(tw.events) and len(tr.events) <= len(tw.events)
    assert dw["findings"] == dr["findings"]
    for sid in ("overview", "findings", "summary", "events"):
        assert _section(pw, sid) == _section(pr, sid), sid
    assert dw["events"] == dr["events"]
    assert {k: v for k, v in sw.items() if k not in ("bytes", "bins")} == \
        {k: v for k, v in sr.items() if k not in ("bytes", "bins")}
    assert set(dw["figs"]) == set(dr["figs"])
    for fid in dw["figs"]:
        a, b = dw["figs"][fid], dr["figs"][fid]
        assert a["layout"] == b["layout"], fid
        drawn = [t for t in a["data"] if not str(t.get("name", "")).startswith("aggregated")]
        assert drawn == [t for t in b["data"] if not str(t.get("name", "")).startswith("aggregated")], fid
        agg = [sum(len(h.split("<br>")) and int(re.match(r"<b>(\d+)", h).group(1)) for h in t["hovertext"])
               for t in (a["data"], b["data"]) for t in t if str(t.get("name", "")).startswith("aggregated")]
        assert len(set(agg)) <= 1, (fid, agg)  # the same number of events aggregated
    return tr


@pytest.mark.parametrize("trace", SAMPLES, ids=lambda p: p.name)
def test_reduced_report_is_the_whole_report(trace, monkeypatch):
    _same_pages(trace, monkeypatch)


def test_reduced_report_of_a_generated_trace(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate
    path = tmp_path / "gen.jsonl"
    generate(str(path), 40_000)
    monkeypatch.setattr(reduce, "STEPS_KEPT", 300)  # > the step budget of BUDGET (200)
    monkeypatch.setattr(reduce, "ACC_KEPT", 500)  # the accepted figure's budget at BUDGET
    tr = _same_pages(path, monkeypatch)
    assert len(tr.events) < tr.totals.n // 2  # most of the trace was let go (counted into time bins)


def test_report_command_reads_a_big_trace_in_two_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report_cmd, "WHOLE_UP_TO", 100)
    trace = ROOT / "sample_traces" / "live_gpu_pd_eagle_v1.jsonl.zst"
    out = tmp_path / "r.html"
    assert report_cmd.run(trace, out) == 0
    err = capsys.readouterr().err
    assert "18,814 events read in two passes" in err and "held to draw the page" in err, err
    data = report.unpack_data(out.read_text())
    assert data["events"]["total"] == 18814
