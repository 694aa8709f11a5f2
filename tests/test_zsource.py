"""The viewer's lazy index on a compressed trace, in place (issue 22): a .jsonl.zst that pdtrace
wrote (zstd's seekable format) is indexed through its frames, with the offsets, events and
search answers of the plain trace, and no temporary copy; a damaged frame is skipped to the
next one (the seek table says where); another tool's single-stream .zst is decompressed to a temporary file first (and
the viewer says so). Traces: the bundled samples and bench/gen_trace.py's generator, written
by pdtrace's own writer (frames made small here so lines cross frame ends)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import zstandard

from pdtrace.tracefile import compress
from pdtrace.commands.view import _remove_decompressed, open_source
from pdtrace.errors import TraceError
from pdtrace.index.trace_index import TraceIndex
from pdtrace.tracefile.trace import load, write_trace
from pdtrace.viewers.tui.app import PdtraceViewer
from pdtrace.tracefile.zsource import FrameSource

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"


def _rewrite(src: Path, dst: Path) -> None:
    tr = load(str(src))
    events = [{k: v for k, v in e.items() if k != "block_ids_derived"} for e in tr.events]
    write_trace(str(dst), tr.header, events, {k: v for k, v in tr.footer.items() if k != "digest"})


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """(plain, seekable .zst) of a generated 20k-event trace, 64 KiB frames (a few hundred)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate

    gen = tmp_path / "gen.jsonl"
    generate(str(gen), 20_000)
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.zst"
    _rewrite(gen, plain)
    monkeypatch.setattr(compress, "FRAME_BYTES", 64 << 10)
    _rewrite(gen, packed)
    assert len(compress.seek_table(str(packed)) or []) > 50
    return plain, packed


def _columns(idx: TraceIndex) -> tuple:
    return (list(idx.starts), list(idx.lengths), list(idx.kinds), list(idx.steps), list(idx.reqs),
            list(idx.insts), idx.req_names, idx.inst_names, idx.header, idx.footer,
            [(p.line, p.reason) for p in idx.problems])


def test_a_seekable_zst_is_indexed_in_place_like_the_plain_trace(pair):
    plain, packed = pair
    a = TraceIndex(str(plain), lenient=False).build()
    b = TraceIndex(str(packed), lenient=False).build()
    assert b.size == plain.stat().st_size > packed.stat().st_size  # offsets of the uncompressed lines
    assert _columns(a) == _columns(b) and len(a) > 20_000
    rng = random.Random(7)
    picks = rng.sample(range(len(a)), 500) + [0, len(a) - 1]
    assert [a.event(i) for i in picks] == [b.event(i) for i in picks]
    assert list(a.iter_events()) == list(b.iter_events())
    req = a.event(len(a) // 2)["req"]
    for text in (req, '"ev":"acc.truth"', "no such text"):
        for start, direction in ((0, 1), (len(a) - 1, -1), (len(a) // 2, 1), (len(a) // 2, -1)):
            assert a.search(text, start, direction) == b.search(text, start, direction), (text, start, direction)
    assert b.search(req, 0, 1) is not None


def test_a_line_longer_than_a_frame_and_reads_across_frames(tmp_path, monkeypatch):
    """Frames of 96 bytes: every line spans two or more frames (the shortest, sched.output, is 125 bytes); the
    bundled buggy sample."""
    monkeypatch.setattr(compress, "FRAME_BYTES", 96)
    plain = tmp_path / "s.jsonl"
    packed = tmp_path / "s.jsonl.zst"
    _rewrite(SAMPLES / "stale_read_rowmoves_buggy.jsonl", plain)
    _rewrite(SAMPLES / "stale_read_rowmoves_buggy.jsonl", packed)
    a, b = TraceIndex(str(plain)).build(), TraceIndex(str(packed)).build()
    assert min(b.lengths) > 96 and max(b.lengths) > 3 * 96 and _columns(a) == _columns(b)
    assert [a.event(i) for i in range(len(a))] == [b.event(i) for i in range(len(b))]
    src = FrameSource(str(packed), compress.seek_table(str(packed)))
    try:
        text = plain.read_bytes()
        assert b"".join(blk for _off, blk in src.blocks()) == text
        assert all(text[off:off + len(blk)] == blk for off, blk in src.blocks(1000))
        for off, n in ((0, 10), (127, 2), (1000, 3000), (len(text) - 5, 100)):
            assert src.pread(n, off) == text[off:off + n]
    finally:
        src.close()


def test_view_opens_pdtrace_zst_without_a_temporary_copy(pair, capsys):
    _plain, packed = pair
    idx = open_source(str(packed))
    try:
        assert idx.path == str(packed) and idx.head().startswith(b'{"ev":"trace.header"')
        idx.build()
        assert idx.footer is not None and not idx.problems
    finally:
        idx.close()
    assert "decompress" not in capsys.readouterr().err


@pytest.mark.asyncio
async def test_the_viewer_shows_findings_from_a_seekable_zst(tmp_path):
    packed = tmp_path / "b.jsonl.zst"
    _rewrite(SAMPLES / "stale_read_rowmoves_buggy.jsonl", packed)
    plain_findings = None
    for path in (SAMPLES / "stale_read_rowmoves_buggy.jsonl", packed):
        app = PdtraceViewer(TraceIndex(str(path)))
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(300):
                if app.findings_done:
                    break
                await pilot.pause(0.02)
            assert app.findings_done
            await pilot.press("f")
            await pilot.pause()
            got = [(f.kind, f.req, f.step) for f in app.findings]
            assert app.query_one("TabbedContent").active == "acc"
            assert "STALE" in app.query_one("#pane-acc").text
        plain_findings = got if plain_findings is None else plain_findings
    assert got == plain_findings and len(got) > 1


def _damage(packed: Path, ks: list[int], name: str) -> tuple[Path, list]:
    frames = compress.seek_table(str(packed))
    data = bytearray(packed.read_bytes())
    for k in ks:
        data[frames[k][0]:frames[k][0] + 8] = bytes(8)  # the frame's magic and header
    bad = packed.with_name(name)
    bad.write_bytes(bytes(data))
    return bad, frames


@pytest.mark.parametrize("where", ["middle", "two-in-a-row", "last"])
def test_a_damaged_frame_is_skipped_to_the_next_one(pair, where):
    """Issue 39: the seek table says where the next frame starts, so the lines after a damaged frame are
    indexed at their true offsets; only the lines the frame held (and the two it cut) are lost, and the
    problem says how many bytes. Oracle: the plain trace's own index."""
    plain, packed = pair
    n_frames = len(compress.seek_table(str(packed)))
    ks = {"middle": [n_frames // 2], "two-in-a-row": [n_frames // 2, n_frames // 2 + 1], "last": [n_frames - 1]}[where]
    bad, frames = _damage(packed, ks, f"bad-{where}.jsonl.zst")
    idx = TraceIndex(str(bad)).build()
    full = TraceIndex(str(plain)).build()
    src = FrameSource(str(packed), frames)
    lo, hi = src.starts[ks[0]], (src.starts[ks[-1]] + frames[ks[-1]][2])
    # every event of the plain trace whose line lies wholly outside the damaged frames' bytes is indexed, at
    # its offset; none inside
    expect = [s for s, ln in zip(full.starts, full.lengths) if s + ln <= lo or s >= hi]
    got = list(idx.starts)
    seen = set(got)  # (once: inside the comprehension it was rebuilt per line)
    assert seen <= set(full.starts) and got == [s for s in expect if s in seen]
    assert len(expect) - len(got) <= 1  # at most the line that starts right at the frame after the gap
    (gap,) = idx.gaps
    assert gap["frames"] == len(ks) and gap["at"] <= lo and gap["at"] + gap["lost"] >= min(hi, src.size)
    reasons = [p.reason for p in idx.problems]
    assert reasons[0].startswith(f"{gap['lost']} uncompressed bytes lost ({len(ks)} damaged zstd frame(s)")
    assert f"first: corrupt zstd frame at byte {frames[ks[0]][0]} of the compressed file" in reasons[0]
    if where == "last":
        assert idx.footer is None and reasons == reasons[:1]  # the footer was in the gap: said once, by the gap
    else:
        assert idx.footer is not None and len(reasons) == 1
    with pytest.raises(TraceError, match=f"bytes lost .*corrupt zstd frame at byte {frames[ks[0]][0]}"):
        TraceIndex(str(bad), lenient=False).build()


def test_a_single_stream_zst_is_decompressed_for_the_viewer(tmp_path, capsys):
    """Another tool's .zst (one stream, no seek table), as the GPU-recorded samples are."""
    one = tmp_path / "one.jsonl.zst"
    one.write_bytes(zstandard.ZstdCompressor().compress((SAMPLES / "stale_read_rowmoves_buggy.jsonl").read_bytes()))
    with pytest.raises(TraceError, match="without a seek table"):
        TraceIndex(str(one))
    for src in (one, SAMPLES / "live_gpu_pd_eagle_v2.jsonl.zst"):
        idx = open_source(str(src))
        try:
            assert idx.path != str(src) and os.path.exists(idx.path) and idx.build().footer is not None
        finally:
            idx.close()
            _remove_decompressed(idx.path)
        assert not os.path.exists(idx.path)
        assert "without a seek table (written by another tool, or a pdtrace trace cut before its end); decompressing to" in capsys.readouterr().err


def test_a_refused_single_stream_zst_leaves_no_copy_and_names_the_users_file(tmp_path, monkeypatch):
    import tempfile

    from pdtrace.errors import PdtraceError

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cases = {"foreign.jsonl.zst": b'{"hello":1}\n', "empty.jsonl.zst": b""}
    for name, text in cases.items():
        p = tmp_path / name
        p.write_bytes(zstandard.ZstdCompressor().compress(text))
        with pytest.raises(PdtraceError) as exc:
            open_source(str(p))
        assert str(exc.value).startswith(f"{p}:") and "pdtrace-view-" not in str(exc.value)
    bad = tmp_path / "bad.jsonl.zst"  # not decompressible at all
    bad.write_bytes(zstandard.ZstdCompressor().compress(b"x" * 1000)[:-6] + b"\0" * 6)
    with pytest.raises(PdtraceError, match="cannot decompress"):
        open_source(str(bad))
    assert list(scratch.iterdir()) == []  # every temporary copy removed


@pytest.mark.asyncio
async def test_the_viewer_names_the_users_file_not_the_copy(capsys):
    idx = open_source(str(SAMPLES / "live_gpu_pd_eagle_v2.jsonl.zst"))
    try:
        app = PdtraceViewer(idx, use_default_detect=False)
        async with app.run_test(size=(100, 30)):
            assert app.sub_title == "live_gpu_pd_eagle_v2.jsonl.zst"
        assert idx.path.endswith("v2.jsonl")
    finally:
        idx.close()
        _remove_decompressed(idx.path)
    assert "MB decompressed" in capsys.readouterr().err


def test_a_damaged_first_frame_is_one_clear_error(pair):
    from pdtrace.errors import PdtraceError

    _plain, packed = pair
    data = bytearray(packed.read_bytes())
    data[4:12] = b"\xff" * 8  # frame 0's header (its magic kept: still a .zst); the seek table adds up
    bad = packed.with_name("bad0.jsonl.zst")
    bad.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="^.*bad0.jsonl.zst:1: corrupt zstd frame at byte 0"):
        TraceIndex(str(bad)).build()
    with pytest.raises(PdtraceError, match="bad0.jsonl.zst: cannot read: corrupt zstd frame at byte 0"):
        open_source(str(bad))


@pytest.mark.asyncio
async def test_findings_after_a_skipped_frame_are_not_verdicts(pair):
    """Reading on past a damaged frame (above) feeds the detectors a trace with a hole: the lost
    lines held batch.add / row moves / allocations, and reads after it looked like reads through
    another request's row (30 such warnings on this generated trace). The viewer makes every
    finding that cites an event after the gap inconclusive, saying so; the findings before it
    stand. Oracle: the intact trace's findings whose events all lie before the gap."""
    plain, packed = pair
    n_frames = len(compress.seek_table(str(packed)))
    bad, _frames = _damage(packed, [n_frames // 2], "bad-findings.jsonl.zst")

    async def findings(path):
        app = PdtraceViewer(TraceIndex(str(path)))
        async with app.run_test(size=(120, 40)) as pilot:
            while not app.findings_done:
                await pilot.pause(0.05)
            return app.findings, app.index

    whole, _ = await findings(plain)
    got, idx = await findings(bad)
    (gap,) = idx.gaps
    first_after = next(i for i in range(len(idx)) if idx.starts[i] >= gap["at"])
    last_before_id = idx.event_id(first_after - 1)
    verdicts = [f for f in got if f.severity != "inconclusive"]
    assert verdicts and all(max(f.event_ids) <= last_before_id for f in verdicts)
    before = [f for f in whole if f.severity != "inconclusive" and max(f.event_ids) <= last_before_id]
    assert [(f.kind, f.req, f.step) for f in verdicts] == [(f.kind, f.req, f.step) for f in before]
    after = [f for f in got if "after_gap" in (f.data or {})]
    assert after and all(f.title.startswith("(after a damaged stretch)") for f in after)
    assert all(f"lost at line {gap['line']}" in f.explanation for f in after)
