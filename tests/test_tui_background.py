"""The viewer checks a big trace in a child process (issue 22): pdtrace's streamed detectors
(`check --lenient`), started with the indexing, so the viewer's memory stays the index's.
Real processes throughout (spawned children, killed for real); ``detect_max_bytes=0`` makes
the bundled samples count as big. Compared with the in-process check and with `check`."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import pytest

from pdtrace.commands.view import _remove_decompressed, open_source
from pdtrace.detectors import background
from pdtrace.detectors.background import Job
from pdtrace.index.trace_index import TraceIndex
from pdtrace.viewers.tui.app import PdtraceViewer

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"


@pytest.fixture
def jobs(monkeypatch):
    """The Jobs the viewer starts (the class itself runs unchanged)."""
    made: list[Job] = []

    class Spy(Job):
        def __init__(self, path):
            super().__init__(path)
            made.append(self)

    monkeypatch.setattr(background, "Job", Spy)
    return made


async def _findings(app, pilot, rounds=1500):
    for _ in range(rounds):
        if app.findings_done:
            break
        await pilot.pause(0.02)
    assert app.findings_done, app.query_one("#findings").border_title


def _key(findings):
    return [(f.kind, f.req, f.step, f.inst, f.title, tuple(f.event_ids)) for f in findings]


@pytest.mark.asyncio
@pytest.mark.parametrize("sample", ["stale_read_rowmoves_buggy.jsonl", "lookahead_aligned16_k1_buggy.jsonl",
                                    "live_gpu_pd_eagle_v1.jsonl.zst"])
async def test_a_big_trace_is_checked_in_a_child_with_the_in_process_findings(sample, jobs):
    indexes = [open_source(str(SAMPLES / sample)) for _ in range(2)]  # (a single-stream .zst: temp copies)
    try:
        here = PdtraceViewer(indexes[0])
        async with here.run_test(size=(120, 40)) as pilot:
            await _findings(here, pilot)
        assert not jobs  # small: in this process
        app = PdtraceViewer(indexes[1], detect_max_bytes=0)
        async with app.run_test(size=(120, 40)) as pilot:
            await _findings(app, pilot)
            assert app.findings_note == ""
    finally:
        for idx in indexes:
            idx.close()
            _remove_decompressed(idx.path)
    assert len(jobs) == 1 and jobs[0].proc.exitcode == 0  # a child ran the check and ended
    assert _key(app.findings) == _key(here.findings)
    assert {k: (c.status, c.events) for k, c in app.coverage.items()} == \
        {k: (c.status, c.events) for k, c in here.coverage.items()}


def test_the_job_reports_progress_and_the_findings_of_check(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate

    p = tmp_path / "g.jsonl"
    generate(str(p), 150_000)
    job = Job(str(p))
    fractions, msg = [], None
    while msg is None:
        msg = job.poll(0.5)
        fractions.append(job.fraction)
    assert msg[0] == "done" and fractions[-1] > 0 and fractions == sorted(fractions)
    findings, cov = background.check(str(p))
    assert _key(msg[1]) == _key(findings) and len(findings) > 0
    assert {k: c.status for k, c in msg[2].items()} == {k: c.status for k, c in cov.items()}


def test_a_failed_or_killed_child_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not a trace\n")
    job = Job(str(bad))
    while (msg := job.poll(0.5)) is None:
        pass
    assert msg[0] == "failed" and str(bad) in msg[1] and "\n" not in msg[1]
    job = Job(str(SAMPLES / "stale_read_rowmoves_buggy.jsonl"))
    job.proc.kill()
    while (msg := job.poll(0.5)) is None:
        pass
    assert msg[0] == "failed" and f"exit code -{9}" in msg[1]


@pytest.mark.asyncio
async def test_a_killed_child_says_so_and_d_checks_in_the_viewer(monkeypatch):
    killed: list[Job] = []

    class Killed(Job):  # the child is killed as soon as it starts (as the OOM killer would)
        def __init__(self, path):
            super().__init__(path)
            self.proc.kill()
            killed.append(self)

    monkeypatch.setattr(background, "Job", Killed)
    app = PdtraceViewer(TraceIndex(str(SAMPLES / "stale_read_rowmoves_buggy.jsonl")), detect_max_bytes=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await _findings(app, pilot)
        assert not app.findings and "detectors failed in their process" in app.findings_note
        assert "press D" in app.findings_note
        app.findings_done = False
        await pilot.press("D")
        await _findings(app, pilot)
        assert len(killed) == 1 and app.findings and not app.findings_note  # D ran them here
    assert killed[0].proc.exitcode == -9


@pytest.mark.asyncio
async def test_leaving_the_viewer_stops_the_child(jobs, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate

    p = tmp_path / "g.jsonl"
    generate(str(p), 150_000)
    app = PdtraceViewer(TraceIndex(str(p)), detect_max_bytes=0)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(200):
            if jobs:
                break
            await pilot.pause(0.01)
        await pilot.press("q")
    for _ in range(100):
        if not jobs[0].proc.is_alive():
            break
        await asyncio.sleep(0.05)
    assert not jobs[0].proc.is_alive() and jobs[0].proc.exitcode != 0 and os.path.exists(p)
