"""The viewer's index built in a child process (issue 39: a 10M-event trace's scan off the UI's
process): ``TraceIndex.scan(child=True)`` must give exactly the index the in-process scan gives.
Oracle: the in-process ``TraceIndex`` of the same file (itself held to the loader in
test_index.py), compared field by field, on every bundled sample, on bench/gen_trace.py's
traces cut into many batches (plain and seekable .zst with small frames), on damaged ones
(corrupt lines, a damaged zstd frame), and on strict reads that stop at the first problem."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import pytest

from pdtrace.errors import TraceError
from pdtrace.index.trace_index import TraceIndex
from pdtrace.tracefile import compress
from pdtrace.tracefile.trace import load, write_trace

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted((ROOT / "sample_traces").glob("*.jsonl")) + [ROOT / "pdtrace" / "samples" / "demo_lookahead_misalignment.jsonl"]


def _state(idx: TraceIndex) -> dict:
    return {
        "columns": [list(getattr(idx, c)) for c in ("starts", "lengths", "kinds", "steps", "reqs", "insts")],
        "req_names": idx.req_names, "req_code": idx.req_code, "inst_names": idx.inst_names,
        "req_events": {rc: list(a) for rc, a in idx.req_events.items()}, "req_insts": list(idx.req_insts),
        "step_ranges": idx.step_ranges, "first_of_kind": idx.first_of_kind, "remote_req": idx.remote_req,
        "id_to_ord": idx.id_to_ord, "ord_to_id": idx.ord_to_id, "header": idx.header, "footer": idx.footer,
        "problems": [(p.line, p.reason) for p in idx.problems], "gaps": idx.gaps,
        "stream_damaged": idx.stream_damaged, "done": idx.done,
    }


def _both(path: Path, lenient: bool = True, batch_time: float = 0.0) -> tuple[TraceIndex, TraceIndex]:
    ref = TraceIndex(str(path), lenient=lenient).build()
    got = TraceIndex(str(path), lenient=lenient)
    progress = list(got.scan(batch_time=batch_time, child=True))
    assert progress[-1].done and all(not p.done for p in progress[:-1])
    assert [p.events for p in progress] == sorted(p.events for p in progress)  # grows, batch by batch
    return ref, got


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_sample_indexes_the_same_in_a_child(path):
    ref, got = _both(path)
    assert _state(got) == _state(ref)
    assert [got.event(i) for i in range(len(got))] == [ref.event(i) for i in range(len(ref))]


@pytest.mark.parametrize("path", sorted((ROOT / "sample_traces").glob("*.jsonl.zst")), ids=lambda p: p.name)
def test_every_recorded_gpu_trace_indexes_the_same_in_a_child(path):
    """The traces recorded live on GPUs (real vLLM, one zstd stream each: `pdtrace view` indexes its
    decompressed copy, as here)."""
    from pdtrace.commands.view import _remove_decompressed, open_source

    src = open_source(str(path))
    try:
        ref, got = _both(Path(src.path))
        assert len(got) > 100 and _state(got) == _state(ref)
    finally:
        src.close()
        _remove_decompressed(src.path)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A 60k-event generated trace (bugs injected), plain (several 4 MiB blocks) and seekable .zst
    with 64 KiB frames (hundreds of batches, lines crossing frame ends)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate

    d = tmp_path_factory.mktemp("child")
    plain = d / "t.jsonl"
    generate(str(plain), 60_000)
    tr = load(str(plain))
    packed = d / "t.jsonl.zst"
    old = compress.FRAME_BYTES
    compress.FRAME_BYTES = 64 << 10
    try:
        write_trace(str(packed), tr.header, [{k: v for k, v in e.items() if k != "block_ids_derived"} for e in tr.events],
                    {k: v for k, v in tr.footer.items() if k != "digest"})
    finally:
        compress.FRAME_BYTES = old
    return plain, packed


def test_a_generated_trace_in_many_batches(generated):
    for path in generated:
        ref, got = _both(path)
        assert len(got) >= 60_000 and _state(got) == _state(ref)


def test_damaged_lines_and_ids_off_their_ordinals(generated, tmp_path):
    """Corrupt lines (lenient: problems, and every later event's id differs from its ordinal) and a
    cut last line; strict: the same first problem, raised in the parent."""
    plain, _ = generated
    lines = plain.read_bytes().splitlines(keepends=True)
    for k in (5, 20_000, 40_000):
        lines[k] = b"{not json\n"
    lines[30_000] = b'{"ev": "sched.step", "t": 1}\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:-1]) + lines[-1][:-9])
    ref, got = _both(bad)
    assert _state(got) == _state(ref) and ref.id_to_ord and len(ref.problems) >= 5
    with pytest.raises(TraceError) as want:
        TraceIndex(str(bad), lenient=False).build()
    with pytest.raises(TraceError) as err:
        list(TraceIndex(str(bad), lenient=False).scan(child=True))
    assert (err.value.path, err.value.line, err.value.reason, err.value.damaged) == \
        (want.value.path, want.value.line, want.value.reason, want.value.damaged) == (str(bad), 6, "corrupt line: not valid JSON", True)


def test_a_damaged_zstd_frame_is_skipped_the_same_way(generated, tmp_path):
    _, packed = generated
    frames = compress.seek_table(str(packed))
    data = bytearray(packed.read_bytes())
    k = len(frames) // 2
    data[frames[k][0]:frames[k][0] + 8] = bytes(8)
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(bytes(data))
    ref, got = _both(bad)
    assert _state(got) == _state(ref) and len(ref.gaps) == 1 and ref.stream_damaged


def test_files_that_are_not_traces_fail_the_same_way(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "f.jsonl").write_bytes(b'{"hello": 1}\n')
    for name in ("e.jsonl", "f.jsonl"):
        with pytest.raises(TraceError) as want:
            TraceIndex(str(tmp_path / name)).build()
        with pytest.raises(TraceError) as err:
            list(TraceIndex(str(tmp_path / name)).scan(child=True))
        assert (err.value.line, err.value.reason) == (want.value.line, want.value.reason)


def test_a_child_that_dies_ends_the_scan_with_an_error_not_a_short_index(generated):
    plain, _ = generated
    idx = TraceIndex(str(plain))
    scan = idx.scan(batch_time=0.0, child=True)
    next(scan)
    (proc,) = [p for p in multiprocessing.active_children() if p.name == "pdtrace-index"]
    proc.kill()
    t = time.monotonic()
    with pytest.raises(TraceError, match=r"the indexing process ended \(exit code -9\) before the end of the trace"):
        for _ in scan:
            pass
    assert not idx.done and time.monotonic() - t < 30
    assert not [p for p in multiprocessing.active_children() if p.name == "pdtrace-index"]


def test_closing_the_scan_stops_the_child(generated):
    """The viewer cancels its index worker on quit: the child goes with the generator."""
    plain, _ = generated
    scan = TraceIndex(str(plain)).scan(batch_time=0.0, child=True)
    next(scan)
    scan.close()
    assert not [p for p in multiprocessing.active_children() if p.name == "pdtrace-index"]


@pytest.mark.asyncio
async def test_the_viewer_shows_the_same_when_its_index_is_built_in_a_child():
    """The viewer with the child scan forced (``scan_child_bytes=0``; `pdtrace view` does it from
    64 MiB on) on the lookahead sample: the same requests, steps, findings and Block map as with the
    in-process scan; the progress bar goes once indexed."""
    from pdtrace.viewers.tui.app import PdtraceViewer

    path = str(ROOT / "sample_traces" / "lookahead_aligned16_k1_buggy.jsonl")
    seen = []
    for child_bytes in (0, 1 << 62):
        app = PdtraceViewer(TraceIndex(path), scan_child_bytes=child_bytes)
        assert app.scan_child == (child_bytes == 0)
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(500):
                if app.findings_done:
                    break
                await pilot.pause(0.02)
            assert app.indexed and app.findings_done and not app.query_one("#progress").display
            for _ in range(4):  # (it opens on the first root cause's finding a refresh later: then "f" moves on)
                await pilot.pause(0.05)
            await pilot.press("f")
            await pilot.pause()
            seen.append((len(app.index), app.index.steps_of(), [(f.kind, f.req, f.step) for f in app.findings],
                         app.req, app.step, app.query_one("#pane-blocks").text))
    assert seen[0] == seen[1] and seen[0][2] and "MISMATCH" in seen[0][5]
