"""`check -j N` (pdtrace.detectors.parallel, issue 22): the detectors split over processes,
each parsing only the lines of the kinds its detectors read, must give exactly what the
one-process stream gives (findings in the same order, coverage, event count, header and
footer) on every bundled sample (recorded from real vLLM code, four of them live on GPUs),
on a generated trace with every bug class injected, and on the labelled corpus (real vLLM
scheduler / connector code; tests/test_corpus.py builds it) -- and fall back to that stream
on whatever its line filter cannot judge: damaged lines, lines that do not start with their
kind, events without ids, a child process that dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrace.detectors import parallel, stream
from pdtrace.detectors.coverage import coverage_of, incomplete_reason
from pdtrace.tracefile.segments import LineFilter, NeedsScan
from pdtrace.tracefile.writer import write_trace

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted([*(ROOT / "sample_traces").glob("*.jsonl"), *(ROOT / "sample_traces").glob("*.jsonl.zst")])
HEADER = {"ev": "trace.header", "schema": "pdtrace", "schema_version": 2, "pdtrace": "0.1.0", "versions": {},
          "origin": "test", "instances": ["P", "D"]}


def _outcome(res: stream.Result) -> tuple:
    cov = coverage_of(res.summary, res.footer, incomplete=incomplete_reason(res.footer, res.problems), notes=res.notes)
    return ([f.to_dict() for f in res.findings], {k: c.to_dict() for k, c in cov.items()}, res.n_events,
            res.header, res.footer, [str(p) for p in res.problems], sorted(map(str, res.summary.runner_values())))


def _same_every_way(path: str, lenient: bool = False, splits: tuple = (2, 3, 4)) -> stream.Result:
    want = stream.run(path, lenient=lenient)
    for jobs in splits:
        got = parallel.run(path, jobs=jobs, lenient=lenient)
        assert got.jobs == jobs, (path, jobs)  # it did split (no fall-back)
        assert _outcome(got) == _outcome(want), (path, jobs)
    return want


@pytest.mark.parametrize("trace", SAMPLES, ids=lambda p: p.name)
def test_split_check_equals_the_one_process_check_on_every_sample(trace):
    _same_every_way(str(trace))


def test_split_check_on_a_generated_trace_with_every_bug_class(tmp_path):
    """bench/gen_trace.py's trace (the one bench/scale.py times), small: several findings of
    each class, found the same split as whole; with --only and --request too."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from gen_trace import generate
    finally:
        sys.path.remove(str(ROOT / "bench"))
    path = str(tmp_path / "gen.jsonl")
    generate(path, 60_000)
    want = _same_every_way(path, splits=(2, 4))
    assert {f.kind for f in want.findings} == set(stream.STREAMS)
    for only in (["stale-accepted-count-read", "lookahead-block-misalignment"],
                 ["drafter-window-outside-allocation", "connector-metadata-cleared-before-drafter"]):
        a, b = stream.run(path, only=only), parallel.run(path, only=only, jobs=2)
        assert b.jobs == 2 and _outcome(a) == _outcome(b) and a.findings
    req = want.findings[0].req
    a, b = stream.run(path, request=req), parallel.run(path, request=req, jobs=2)
    assert _outcome(a) == _outcome(b) and b.request.seen
    a, b = stream.run(path, request="no-such"), parallel.run(path, request="no-such", jobs=2)
    assert not b.request.seen and b.request.known == a.request.known and len(a.request.known) > 11  # (every id: what --request may have meant)


@pytest.mark.vllm
def test_split_check_equals_the_one_process_check_on_the_corpus(tmp_path):
    pytest.importorskip("vllm")
    from pdtrace.testing import scenarios

    found = 0
    for name in scenarios.SCENARIOS:
        path = str(tmp_path / f"{name}.jsonl")
        write_trace(path, dict(HEADER), scenarios.build(name).events)
        found += len(_same_every_way(path, splits=(2, 4)).findings)
    assert found  # (the corpus has buggy scenarios: not a comparison of empty lists)


def _rewrite(src: Path, dst: Path, edit) -> None:
    lines = src.read_bytes().splitlines(keepends=True)
    dst.write_bytes(b"".join(edit(lines)))


SAMPLE = ROOT / "sample_traces" / "stale_read_rowmoves_buggy.jsonl"


@pytest.mark.parametrize("case", ["bad-json", "key-order", "no-id", "cut"])
def test_what_the_line_filter_cannot_judge_falls_back_to_one_process(tmp_path, case):
    """Damaged or unusual lines: the split check gives up (``jobs`` 1) and the result is the
    one-process stream's, which reads the file through scan where it must. A recording cut
    short (no footer, a last line cut) is judged by every part alike: it stays split."""
    dst = tmp_path / f"{case}.jsonl"

    def edit(lines):
        i = len(lines) // 2
        if case == "bad-json":
            lines[i] = b'{"ev":"acc.read", oops\n'
        elif case == "key-order":  # an event whose "ev" is not its first key (digest no longer matches)
            e = json.loads(lines[i])
            lines[i] = json.dumps({"id": e.pop("id"), **e}).encode() + b"\n"
        elif case == "no-id":
            e = json.loads(lines[i])
            del e["id"]
            lines[i] = json.dumps(e, separators=(",", ":")).encode() + b"\n"
        else:
            lines = lines[:-1]
            lines[-1] = lines[-1][:20]
        return lines
    _rewrite(SAMPLE, dst, edit)
    want = stream.run(str(dst), lenient=True)
    got = parallel.run(str(dst), jobs=2, lenient=True)
    assert got.jobs == (2 if case == "cut" else 1) and _outcome(got) == _outcome(want)


def _unsigned_lines() -> list[bytes]:
    """The sample's lines with its footer's digest removed: an unsigned trace (the samples are
    written by a recorder that signs)."""
    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    footer = json.loads(lines[-1])
    footer.pop("digest", None)
    lines[-1] = json.dumps(footer, separators=(",", ":")).encode() + b"\n"
    return lines


def test_an_unsigned_trace_with_reordered_keys_still_gives_the_same_findings(tmp_path):
    """No digest to catch it (the footer's digest removed): a line whose "ev" is not
    first is told by the filter of the last part (it starts with no kind), and the check
    falls back."""
    dst = tmp_path / "unsigned.jsonl"
    lines = _unsigned_lines()
    i = next(j for j, ln in enumerate(lines) if b'"ev":"acc.read"' in ln)
    e = json.loads(lines[i])
    lines[i] = json.dumps({"id": e.pop("id"), **e}).encode() + b"\n"
    dst.write_bytes(b"".join(lines))
    want = stream.run(str(dst))
    got = parallel.run(str(dst), jobs=2)
    assert got.jobs == 1 and _outcome(got) == _outcome(want) and want.findings


def test_line_filter_keeps_its_kinds_and_tells_what_it_cannot():
    inc = LineFilter({"acc.read"})
    lines = [b'{"ev":"acc.read","id":1}\n', b'{"ev":"acc.truth","id":2}\n', b'{"ev": "acc.read", "id": 3}\n',
             b'{"ev":"trace.footer"}\n']
    assert inc.mask(lines) == [True, False, True, True]
    exc = LineFilter({"acc.read"}, exclude=True)
    assert exc.mask(lines) == [False, True, False, True]
    with pytest.raises(NeedsScan):
        exc.mask([b'{"id":4,"ev":"acc.read"}\n'])
    from pdtrace.tracefile.eventlist import kind_code
    assert inc.foreign(bytes([kind_code("acc.truth")])) and not inc.foreign(bytes([kind_code("acc.read")]))
    assert exc.foreign(bytes([kind_code("acc.read")])) and not exc.foreign(bytes([kind_code("acc.truth")]))


def test_every_kind_is_summarized_by_exactly_one_part():
    from pdtrace.schema import KINDS
    for jobs in (2, 3, 4):
        parts = parallel.plan((), jobs)
        assert len(parts) == jobs
        seen = [k for p in parts for k in p.summarize]
        assert sorted(seen) == sorted(KINDS)
        for p in parts:  # each part reads what its detectors read
            for det in p.only:
                assert set(parallel.kinds_of(det)) <= p.reads
    assert parallel.plan(["stale-accepted-count-read"], 4) == []  # one detector: one process
    import pickle  # (a spawn start, where fork is not there, pickles each part)
    again = pickle.loads(pickle.dumps(parallel.plan((), 4)))
    assert [(p.only, p.reads, p.summarize) for p in again] == [(p.only, p.reads, p.summarize)
                                                               for p in parallel.plan((), 4)]


def test_a_spawned_child_gives_the_same_result(monkeypatch):
    """Where fork is not there (Windows; macOS may prefer spawn), the children are spawned."""
    monkeypatch.setattr(parallel.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    got = parallel.run(str(SAMPLE), jobs=2)
    assert got.jobs == 2 and _outcome(got) == _outcome(stream.run(str(SAMPLE)))


def test_a_detector_asking_for_a_kind_its_part_did_not_read_is_a_bug(monkeypatch):
    """Never a quietly different verdict: a plan that leaves out a kind a detector reads
    (here spec.window, for the drafter-window detector) meets the part's index refusing it."""
    real = parallel.kinds_of
    monkeypatch.setattr(parallel, "kinds_of", lambda k: tuple(x for x in real(k) if x != "spec.window"))
    with pytest.raises(AssertionError, match="KindNotRead|spec.window"):
        parallel.run(str(ROOT / "sample_traces" / "dflash_window_buggy.jsonl"), jobs=2)


def test_a_child_that_dies_leaves_the_check_to_one_process(monkeypatch):
    if "fork" not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip("the child is replaced through fork")
    monkeypatch.setattr(parallel, "_child", lambda *a: os._exit(9))
    want = stream.run(str(SAMPLE))
    got = parallel.run(str(SAMPLE), jobs=2)
    assert got.jobs == 1 and _outcome(got) == _outcome(want)


def test_check_cli_jobs(tmp_path):
    """`pdtrace check -j 2` (the console entry, a fresh process) writes what `-j 1` writes; a
    negative count is one line, exit 2."""
    outs = []
    for j in ("1", "2"):
        out = tmp_path / f"j{j}.json"
        r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(SAMPLE), "-f", "json", "-j", j, "-o",
                            str(out)], capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        outs.append(out.read_text())
    assert outs[0] == outs[1] and json.loads(outs[0])["findings"]
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(SAMPLE), "-j", "-1"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "pdtrace: error: --jobs must be 0 (auto) or more, not -1"]


def test_auto_jobs_splits_big_traces_only(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert parallel.auto_jobs(str(SAMPLE)) == 1
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as fh:
        fh.truncate(parallel.MIN_AUTO_BYTES)
    assert parallel.auto_jobs(str(big)) == 2
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0})
    assert parallel.auto_jobs(str(big)) == 1


def test_a_trace_written_by_pythons_json_module_still_splits(tmp_path):
    """Another writer's spacing (``{"ev": "KIND", ...}``, json.dumps), footer without a
    digest: the filters know that start too, and the split gives the same result."""
    events = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    events[-1].pop("digest", None)
    dst = tmp_path / "spaced.jsonl"
    dst.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert dst.read_text().startswith('{"ev": "trace.header"')
    want = _same_every_way(str(dst), splits=(2,))
    assert want.findings


def test_a_damaged_line_goes_straight_to_scan(tmp_path, monkeypatch):
    """A line only scan can judge, met by a part: the one-process check that follows reads
    through scan at once (not its fast path again, up to the same line); a line the filter
    cannot tell apart (an event without its id) leaves the one-process fast path its chance."""
    calls = []
    real = stream._run
    monkeypatch.setattr(stream, "_run", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    lines = _unsigned_lines()  # (a digest would fail the damaged trace first)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:40] + [b'{"ev":"acc.read", oops\n'] + lines[41:]))
    got = parallel.run(str(bad), jobs=2, lenient=True)
    assert got.jobs == 1 and got.problems and calls == [False]
    calls.clear()
    e = json.loads(lines[40])
    del e["id"]
    noid = tmp_path / "noid.jsonl"
    noid.write_bytes(b"".join(lines[:40] + [json.dumps(e, separators=(",", ":")).encode() + b"\n"] + lines[41:]))
    got = parallel.run(str(noid), jobs=2)
    assert got.jobs == 1 and calls[0] is True and _outcome(got) == _outcome(stream.run(str(noid)))


def test_check_help_says_how_many_processes_at_most():
    """`check --help` named 4 after the fifth detector made it 5 (a new user saw it): the help
    text of -j is held against parallel.MAX_JOBS."""
    import typer.main

    from pdtrace.cli import app

    check = typer.main.get_command(app).commands["check"]
    (jobs,) = [p for p in check.params if "--jobs" in p.opts]
    assert f"at most {parallel.MAX_JOBS}," in jobs.help and f"runs {parallel.MAX_JOBS};" in jobs.help
