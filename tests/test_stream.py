"""`check` in bounded memory (pdtrace.detectors.stream, issue 22): the trace read in
segments, each fed to the detectors' streams and let go, must give what the whole trace
loaded at once gives (``trace.load`` + ``run_all`` + ``coverage``), on every bundled sample
(recorded from real vLLM code, four of them live on GPUs) with segments of 1, 3, 50 events
and the default; on damaged, unsigned and wrong-typed files it must say what ``load``
says. The corpus (real vLLM scheduler / connector code) is compared in test_corpus.py.
What the streams keep is bounded: checked here on long generated runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdtrace.detectors import run_all, stale_read, drafter_window
from pdtrace.detectors import stream
from pdtrace.detectors.coverage import coverage, coverage_of, incomplete_reason
from pdtrace.detectors.index import Index
from pdtrace.errors import TraceError
from pdtrace.tracefile.trace import load

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted([*(ROOT / "sample_traces").glob("*.jsonl"), *(ROOT / "sample_traces").glob("*.jsonl.zst")])


def _whole(path: str, lenient: bool = False) -> tuple[list, dict]:
    tr = load(path, lenient=lenient)
    cov = coverage(tr.events, tr.header, tr.footer, incomplete=incomplete_reason(tr.footer, tr.problems))
    return [f.to_dict() for f in run_all(tr.events, tr.header)], {k: c.to_dict() for k, c in cov.items()}


def _streamed(path: str, size: int, lenient: bool = False) -> tuple[list, dict, stream.Result]:
    res = stream.run(path, size=size, lenient=lenient)
    cov = coverage_of(res.summary, res.footer, incomplete=incomplete_reason(res.footer, res.problems), notes=res.notes)
    return [f.to_dict() for f in res.findings], {k: c.to_dict() for k, c in cov.items()}, res


@pytest.mark.parametrize("trace", SAMPLES, ids=lambda p: p.name)
def test_streamed_check_equals_the_whole_trace_on_every_sample(trace):
    findings, cov = _whole(str(trace))
    n = len(load(str(trace)).events)
    for size in (1, 3, 50, stream.SEGMENT):
        got, got_cov, res = _streamed(str(trace), size)
        assert got == findings, size
        assert got_cov == cov, size
        assert res.n_events == n and res.complete


def test_the_sample_findings_are_not_empty():
    """(The comparison above would pass on two empty lists: the buggy samples have findings.)"""
    buggy = [p for p in SAMPLES if "buggy" in p.name]
    assert len(buggy) >= 4
    for p in buggy:
        assert _streamed(str(p), 7)[0]


def _copy_lines(src: Path, dst: Path, edit=None) -> list[str]:
    tr = load(str(src))
    lines = [json.dumps(tr.header)] + [json.dumps(e) for e in tr.events] + [json.dumps(tr.footer)]
    if edit:
        lines = edit(lines)
    dst.write_text("\n".join(lines) + "\n")
    return lines


SAMPLE = ROOT / "sample_traces" / "stale_read_rowmoves_buggy.jsonl"


def test_an_unsigned_trace_is_type_checked_as_it_streams(tmp_path):
    """A footer without ``digest`` (a writer that did not type-check): every segment is
    checked as it is read; the findings are the same."""
    dst = tmp_path / "unsigned.jsonl"

    def unsign(lines):
        foot = json.loads(lines[-1])
        foot.pop("digest", None)
        return lines[:-1] + [json.dumps(foot)]
    _copy_lines(SAMPLE, dst, unsign)
    assert "digest" not in load(str(dst)).footer
    assert _streamed(str(dst), 5)[0] == _whole(str(SAMPLE))[0]


def test_a_wrong_type_is_named_as_load_names_it(tmp_path):
    """A hand edit after signing: the digest no longer matches, the stream reads the file
    again through scan, which names the line (as ``load`` does), also for a value a detector
    reads (a row that is a string)."""
    dst = tmp_path / "edited.jsonl"

    def edit(lines):
        for i, ln in enumerate(lines):
            e = json.loads(ln)
            if e.get("ev") == "acc.read":
                e["row"] = "zero"
                lines[i] = json.dumps(e)
                return lines
        raise AssertionError("no acc.read")
    _copy_lines(SAMPLE, dst, edit)
    with pytest.raises(TraceError) as whole:
        load(str(dst))
    with pytest.raises(TraceError) as streamed:
        stream.run(str(dst), size=4)
    assert str(streamed.value) == str(whole.value) and "acc.read" in str(streamed.value)


def test_a_damaged_trace_read_leniently_gives_the_lenient_load(tmp_path):
    """A cut last line and a corrupt line: without --lenient the same error as ``load``;
    with it the same problems, findings and (incomplete) coverage."""
    dst = tmp_path / "damaged.jsonl"
    lines = _copy_lines(SAMPLE, dst)
    lines[40] = '{"ev": "acc.read", "t": 1'  # corrupt
    dst.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the footer cut mid-line
    with pytest.raises(TraceError) as whole:
        load(str(dst))
    with pytest.raises(TraceError) as streamed:
        stream.run(str(dst))
    assert str(streamed.value) == str(whole.value)
    tr = load(str(dst), lenient=True)
    got, got_cov, res = _streamed(str(dst), 9, lenient=True)
    assert (got, got_cov) == _whole(str(dst), lenient=True)
    assert [(p.line, p.reason) for p in res.problems] == [(p.line, p.reason) for p in tr.problems]
    assert res.n_events == len(tr.events) and not res.complete


def _feed_long(cls, events_of_step, steps: int, seg: int = 500):
    """Feed a detector stream ``steps`` steps of generated events, ``seg`` events a segment."""
    st = cls({})
    buf, n = [], 0
    for s in range(steps):
        for e in events_of_step(s):
            e["id"] = n
            n += 1
            buf.append(e)
        if len(buf) >= seg:
            st.feed(Index(buf))
            buf = []
    if buf:
        st.feed(Index(buf))
    return st


def test_stale_read_state_is_bounded_by_its_limits():
    """Twenty thousand steps of copies, reads, truths and row swaps in one worker: the stream
    keeps at most a quarter over MAX_ISSUES copies, the row moves after the oldest of them, and
    TRUTHS_KEPT truths; a row swap read unsynchronized is still found at the end."""
    def step(s):
        evs = [{"ev": "d2h.issue", "pid": 1, "inst": "D", "step": s, "event": f"e{s}", "rows": ["a", "b"]},
               {"ev": "batch.swap", "pid": 1, "inst": "D", "i1": 0, "i2": 1, "req1": "a", "req2": "b",
                "copy": f"e{s}", "landed": "after"},
               {"ev": "batch.swap", "pid": 1, "inst": "D", "i1": 0, "i2": 1, "req1": "b", "req2": "a",
                "copy": f"e{s}", "landed": "after"},
               {"ev": "d2h.done", "pid": 1, "inst": "D", "event": f"e{s}"},
               {"ev": "acc.read", "pid": 1, "inst": "D", "step": s, "req": "a", "row": 0, "value": 1,
                "event": f"e{s}", "event_done": True},
               {"ev": "acc.truth", "pid": 1, "inst": "D", "step": s, "req": "a", "value": 1}]
        if s == 19_999:  # the last step reads row 1 for "a" while the copy is in flight
            evs[3:5] = [{"ev": "acc.read", "pid": 1, "inst": "D", "step": s, "req": "a", "row": 1, "value": 2,
                         "event": f"e{s}", "event_done": False}]
        return evs
    st = _feed_long(stale_read.Stream, step, 20_000)
    high = stale_read.MAX_ISSUES + stale_read.MAX_ISSUES // 4  # trimmed back to MAX_ISSUES past this
    assert stale_read.MAX_ISSUES <= len(st.issues[1]) <= high
    oldest = next(iter(st.issues[1].values()))["id"]
    assert all(m["id"] > oldest for m in st.moves[1]) and len(st.moves[1]) <= 2 * high
    assert len(st.recent) == stale_read.TRUTHS_KEPT
    assert len(st.done[1]) <= stale_read.MAX_DONE + stale_read.MAX_DONE // 4
    (f,) = st.finish()
    assert (f.step, f.data["row"], f.data["truth"], f.severity) == (19_999, 1, 1, "error")


def test_drafter_window_state_is_bounded_by_its_limits():
    """Requests allocated and freed for many steps, with frees missing on one instance: the
    stream keeps at most LIVE_KEPT live and FREED_KEPT freed requests per instance (a quarter
    more between trims), the
    ROW_EVENTS_KEPT latest row changes, and still judges a window past its allocation."""
    def step(s):
        r = f"r{s}"
        evs = [{"ev": "sched.config", "pid": 9, "inst": "D", "block_sizes": [16]}] if s == 0 else []
        evs += [{"ev": "sched.alloc", "pid": 9, "inst": "D", "step": s, "req": r, "block_ids": [[s % 50]]},
                {"ev": "batch.add", "pid": 1, "inst": "D", "row": 0, "req": r},
                {"ev": "spec.window", "pid": 1, "inst": "D", "step": s, "req": r, "start": 0, "end": 8,
                 "method": "dflash"},
                {"ev": "batch.remove", "pid": 1, "inst": "D", "row": 0, "req": r},
                {"ev": "sched.free", "pid": 9, "inst": "D", "req": r},
                {"ev": "sched.alloc", "pid": 8, "inst": "P", "step": s, "req": r, "block_ids": [[s]]}]
        if s == 39_999:
            evs[2]["end"] = 20  # past its one block of 16 slots
        return evs
    st = _feed_long(drafter_window.Stream, step, 40_000, seg=2000)
    assert len(st.live["P"]) <= drafter_window.LIVE_KEPT * 5 // 4
    assert len(st.freed["D"]) <= drafter_window.FREED_KEPT * 5 // 4 and len(st.freed["P"]) >= drafter_window.FREED_KEPT
    assert not st.live["D"] and len(st.rows[1]) <= 2 * drafter_window.ROW_EVENTS_KEPT
    (f,) = st.finish()
    assert (f.req, f.step, f.data["outside_positions"]) == ("r39999", 39_999, [16, 17, 18, 19])


def test_check_streams_and_says_so_in_its_numbers(tmp_path, capsys):
    """`pdtrace check` goes through the stream (not ``load``): its JSON equals the whole
    trace's verdicts; a --what-if run streams too, with the replay of the loaded trace."""
    from pdtrace.commands import check

    calls = []
    orig = stream.run

    def spy(*a, **k):
        calls.append(a)
        return orig(*a, **k)
    stream.run = spy
    try:
        out = tmp_path / "c.json"
        rc = check.run(str(SAMPLE), format="json", output=out)
        doc = json.loads(out.read_text())
        assert calls and rc == 1
        findings, cov = _whole(str(SAMPLE))
        assert [{k: v for k, v in f.items() if k != "cause"} for f in doc["findings"]] == json.loads(json.dumps(findings))
        assert doc["coverage"] == json.loads(json.dumps(cov))
        assert doc["trace"]["events"] == len(load(str(SAMPLE)).events)
        calls.clear()
        check.run(str(SAMPLE), format="json", what_if="fixed-trim", output=out)
        assert calls  # --what-if streams too
        doc = json.loads(out.read_text())
        from pdtrace.detectors import whatif
        assert doc["what_if"]["requests"] == json.loads(json.dumps(whatif.fixed_trim(load(str(SAMPLE)).events)))
        assert [{k: v for k, v in f.items() if k != "cause"} for f in doc["findings"]] == json.loads(json.dumps(findings))
    finally:
        stream.run = orig


def test_a_generated_trace_streams_to_the_same_findings(tmp_path):
    """bench/gen_trace.py's P/D + spec-decode mix with bugs injected (20k events): same
    findings and coverage streamed in segments of 300 as loaded whole."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate
    p = tmp_path / "g.jsonl"
    generate(str(p), 20_000)
    findings, cov = _whole(str(p))
    assert {f["kind"] for f in findings} == set(stream.STREAMS)  # every class
    got, got_cov, _res = _streamed(str(p), 300)
    assert (got, got_cov) == (findings, cov)


def test_a_trace_cut_at_a_line_end_is_read_once(tmp_path, monkeypatch):
    """A recording killed between two lines (every line whole, no footer): without --lenient
    the error ``load`` gives; with it the events, findings and verdicts of the lenient load,
    from one pass (the fast path type-checks each segment; scan is not needed)."""
    dst = tmp_path / "cut.jsonl"
    lines = _copy_lines(SAMPLE, dst)
    dst.write_text("\n".join(lines[:-30]) + "\n")
    with pytest.raises(TraceError) as whole:
        load(str(dst))
    with pytest.raises(TraceError) as streamed:
        stream.run(str(dst), size=7)
    assert str(streamed.value) == str(whole.value)
    monkeypatch.setattr(stream, "scan_segments", None)  # (a second pass would fail here)
    got, got_cov, res = _streamed(str(dst), 7, lenient=True)
    assert (got, got_cov) == _whole(str(dst), lenient=True)
    assert res.n_events == len(lines) - 31 and [p.line for p in res.problems] == [len(lines) - 29]


def test_a_trace_cut_mid_line_is_read_once(tmp_path, monkeypatch):
    """A recording killed mid-write (its last line cut short, no footer): the error and the
    lenient result (events, findings, both problem lines) of ``load``, from one pass."""
    dst = tmp_path / "cut.jsonl"
    lines = _copy_lines(SAMPLE, dst)
    dst.write_text("\n".join(lines[:-30]) + "\n" + lines[-30][:25])
    with pytest.raises(TraceError) as whole:
        load(str(dst))
    with pytest.raises(TraceError) as streamed:
        stream.run(str(dst), size=7)
    assert str(streamed.value) == str(whole.value) and "truncated line" in str(streamed.value)
    tr = load(str(dst), lenient=True)
    monkeypatch.setattr(stream, "scan_segments", None)  # (a second pass would fail here)
    got, got_cov, res = _streamed(str(dst), 7, lenient=True)
    assert (got, got_cov) == _whole(str(dst), lenient=True)
    assert [(p.line, p.reason) for p in res.problems] == [(p.line, p.reason) for p in tr.problems]
    assert len(res.problems) == 2 and res.n_events == len(tr.events)


@pytest.mark.parametrize("trace", SAMPLES, ids=lambda p: p.name)
def test_streamed_what_if_equals_the_whole_trace_replay(trace):
    """`check --what-if fixed-trim` streams: its replay (``whatif.FixedTrim``) fed segments of
    1, 3, 50 and 64k events lists what the replay of the loaded trace lists, per request too."""
    from pdtrace.detectors import whatif
    events = load(str(trace)).events
    reqs = [None, *sorted({e["req"] for e in events if e["ev"] == "nixl.request_finished"})[:2]]
    for req in reqs:
        want = whatif.fixed_trim(events, req)
        for size in (1, 3, 50, stream.SEGMENT):
            res = stream.run(str(trace), size=size, request=req, observe=lambda: whatif.FixedTrim(req))
            assert res.observed.finish() == want, (req, size)


def test_what_if_has_something_to_replay():
    """(The comparison above would pass on empty lists: the buggy lookahead sample changes.)"""
    from pdtrace.detectors import whatif
    events = load(str(ROOT / "sample_traces" / "lookahead_aligned16_k1_buggy.jsonl")).events
    assert whatif.fixed_trim(events)
