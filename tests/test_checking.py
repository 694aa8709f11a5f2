"""One check of a trace file (``detectors.checking.check_file``, issue 35), shared by `pdtrace
check` and the viewer's background check: it parses the header once and hands it to every
pass, and gives the findings and coverage of the whole trace loaded at once (``load`` +
``run_all`` + ``coverage``), streamed or, for a flight-recorder trace, loaded whole. On the
bundled samples (recorded from real vLLM code, four of them live on GPUs), plain and ``.zst``."""

from __future__ import annotations

from pathlib import Path

import pytest

import pdtrace.tracefile.trace as trace_mod
from pdtrace.detectors import background, run_all
from pdtrace.detectors.checking import check_file
from pdtrace.detectors.coverage import coverage
from pdtrace.tracefile.damage import incomplete_reason
from pdtrace.tracefile.trace import load
from pdtrace.tracefile.writer import write_trace

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted([*(ROOT / "sample_traces").glob("*.jsonl"), *(ROOT / "sample_traces").glob("*.jsonl.zst")])


def _whole(path: str) -> tuple[list, dict]:
    tr = load(path)
    cov = coverage(tr.events, tr.header, tr.footer, incomplete=incomplete_reason(tr.footer, tr.problems))
    return [f.to_dict() for f in run_all(tr.events, tr.header)], {k: c.to_dict() for k, c in cov.items()}


def _counting(monkeypatch) -> list[int]:
    """Count the header checks (every parse of line 1 goes through ``_check_header``)."""
    seen = [0]
    orig = trace_mod._check_header

    def counted(*args, **kwargs):
        seen[0] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(trace_mod, "_check_header", counted)
    return seen


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_check_file_reads_the_header_once_and_finds_what_the_whole_trace_shows(path, monkeypatch):
    want = _whole(str(path))
    seen = _counting(monkeypatch)
    got = check_file(str(path))
    assert seen[0] == 1
    assert ([f.to_dict() for f in got.findings], {k: c.to_dict() for k, c in got.coverage.items()}) == want
    assert got.trace.header["schema_version"] >= 1 and got.request_seen


def test_a_flight_recorder_trace_is_loaded_whole_with_its_header_read_once(tmp_path, monkeypatch):
    tr = load(str(ROOT / "sample_traces" / "lookahead_aligned16_k1_buggy.jsonl"))
    ring = tmp_path / "ring.jsonl"
    write_trace(str(ring), {**tr.header, "ring_s": 30.0}, list(tr.events))
    want = _whole(str(ring))
    seen = _counting(monkeypatch)
    got = check_file(str(ring))
    assert seen[0] == 1
    assert type(got.trace).__name__ == "Trace"  # (loaded whole, not streamed)
    assert [f.to_dict() for f in got.findings] == want[0] and want[0]


def test_the_viewers_background_check_is_the_same_check():
    path = str(ROOT / "sample_traces" / "stale_read_rowmoves_buggy.jsonl")
    findings, cov = background.check(path)
    got = check_file(path, lenient=True)
    assert [f.to_dict() for f in findings] == [f.to_dict() for f in got.findings] and findings
    assert {k: c.to_dict() for k, c in cov.items()} == {k: c.to_dict() for k, c in got.coverage.items()}


def test_an_unknown_request_is_said_with_the_requests_the_trace_has():
    path = str(ROOT / "sample_traces" / "lookahead_aligned16_k1_buggy.jsonl")
    got = check_file(path, request="no-such-request")
    assert not got.request_seen and got.requests and got.findings == []
    assert all(r in {e.get("req") for e in load(path).events} for r in got.requests)


@pytest.mark.parametrize("name", ["stale_read_rowmoves_buggy.jsonl", "lookahead_aligned16_k1_buggy.jsonl",
                                  "live_cpu_pd_eagle.jsonl"])
def test_a_request_named_by_either_side_of_its_pd_pair_gets_the_findings_of_both(name):
    """`check --request` with P's id or D's (issue 39, from a new user's pass: naming P's id, as a
    proxy logs it, showed "no findings" while its D side had five). Oracle: the whole check's
    findings whose request is either id of the pair, the pair read from the trace's own
    nixl.remote_alloc events (D's request id and the P id it names); one process, split, and
    the other id give the same."""
    from pdtrace.detectors import _about

    path = str(ROOT / "sample_traces" / name)
    tr = load(path)
    pairs = {(e["req"], e["remote_req"]) for e in tr.events if e["ev"] == "nixl.remote_alloc" and e.get("remote_req")}
    assert pairs
    whole = run_all(tr.events, tr.header)
    for d_req, p_req in sorted(pairs)[:3]:
        want = [f.to_dict() for f in whole if _about(f, {d_req, p_req})]
        for asked, other in ((p_req, d_req), (d_req, p_req)):
            for jobs in (1, 2):
                got = check_file(path, request=asked, jobs=jobs)
                assert got.request_seen and got.pair == [other]
                assert sorted(map(str, (f.to_dict() for f in got.findings))) == sorted(map(str, want)), (asked, jobs)
    assert any(_about(f, {d, p}) for f in whole for d, p in pairs) == (name != "live_cpu_pd_eagle.jsonl")
