"""Zstandard-compressed traces (issue 22): written when the name ends in .zst (record, merge,
write_trace), opened transparently by every reader (check, info, report, view, merge), and a
damaged stream gives one clear line, never a traceback."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import zstandard

from pdtrace import cli
from pdtrace.commands.view import open_source
from pdtrace.tracefile import compress
from pdtrace.tracefile.compress import ZSTD_MAGIC, is_zstd
from pdtrace.tracefile.ends import read_ends
from pdtrace.merge import merge_traces
from pdtrace.tracefile.trace import load, write_trace

ROOT = Path(__file__).resolve().parent.parent
BUGGY = ROOT / "sample_traces/stale_read_rowmoves_buggy.jsonl"


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.run_cli([*map(str, args)])
    return rc, out.getvalue(), err.getvalue()


def _pair(tmp_path) -> tuple[Path, Path]:
    """The buggy sample written by pdtrace's writer twice: plain and .zst."""
    tr = load(str(BUGGY))
    events = [{k: v for k, v in e.items() if k != "block_ids_derived"} for e in tr.events]
    footer = {k: v for k, v in tr.footer.items() if k != "digest"}
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.zst"
    write_trace(str(plain), tr.header, [dict(e) for e in events], dict(footer))
    write_trace(str(packed), tr.header, [dict(e) for e in events], dict(footer))
    return plain, packed


def test_writer_compresses_exactly_the_plain_lines(tmp_path):
    plain, packed = _pair(tmp_path)
    assert packed.read_bytes()[:4] == ZSTD_MAGIC and is_zstd(str(packed)) and not is_zstd(str(plain))
    assert zstandard.ZstdDecompressor().decompressobj().decompress(packed.read_bytes()) == plain.read_bytes()
    assert packed.stat().st_size < plain.stat().st_size / 3
    a, b = load(str(plain)), load(str(packed))
    assert a.events == b.events and a.footer == b.footer and "digest" in b.footer


def test_check_info_and_view_read_a_compressed_trace(tmp_path):
    plain, packed = _pair(tmp_path)
    rc_p, out_p, _ = _cli("check", plain, "-f", "json")
    rc_z, out_z, _ = _cli("check", packed, "-f", "json")
    assert rc_p == rc_z == 1 and out_p.replace(str(plain), "X") == out_z.replace(str(packed), "X")
    assert read_ends(str(packed))[1] == read_ends(str(plain))[1]
    rc, out, _ = _cli("info", packed)
    assert rc == 0 and f"events     {load(str(plain)).footer['events']}" in out
    idx = open_source(str(packed))  # indexed in place through its seek table (tests/test_zsource.py)
    try:
        idx.build()
        assert idx.path == str(packed) and len(idx) == len(load(str(plain)).events) and len(idx.header) > 0
    finally:
        idx.close()


def test_merge_reads_and_writes_zst(tmp_path):
    _plain, packed = _pair(tmp_path)
    out = tmp_path / "m.jsonl.zst"
    merge_traces([packed, packed], str(out))
    assert is_zstd(str(out)) and len(load(str(out)).events) == 2 * len(load(str(packed)).events)


def test_a_damaged_stream_is_one_clear_line(tmp_path):
    _plain, packed = _pair(tmp_path)
    data = bytearray(packed.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = os.urandom(64)
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(bytes(data))
    rc, out, err = _cli("check", bad)
    assert rc == 2 and err.count("\n") <= 2 and str(bad) in err and "Traceback" not in err, err
    rc, out, err = _cli("check", bad, "--lenient")  # a trace this small is one frame: line 1 is in it
    assert rc == 2 and f"{bad}:1: corrupt zstd frame at byte 0 of the compressed file" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(packed.read_bytes()[: len(data) // 2])
    rc, out, err = _cli("info", cut)  # info reads past damage, but this one frame held line 1: nothing to show
    assert rc == 2 and str(cut) in err and "Traceback" not in err and err.count("\n") == 1
    # the cut is named as a cut of the compressed file, not as a line of text the user cannot see
    assert "compressed stream ends early: the file was cut inside its last zstd frame" in err


def test_a_cut_real_trace_keeps_the_lines_before_the_cut(tmp_path):
    src = Path(__file__).resolve().parent.parent / "sample_traces" / "live_gpu_pd_eagle_v1.jsonl.zst"
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(src.read_bytes()[:100_000])
    rc, out, err = _cli("check", cut)
    assert rc == 2 and "compressed stream ends early" in err and "Traceback" not in err
    tr = load(str(cut), lenient=True)
    assert len(tr.events) > 1000 and tr.footer is None
    assert any(p.reason.startswith("compressed stream ends early") for p in tr.problems)


def test_record_writes_a_compressed_trace(tmp_path):
    out = tmp_path / "r.jsonl.zst"
    app = Path(__file__).parent / "programs" / "mp_app.py"
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(out), "--", sys.executable,
                           str(app)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PDTRACE_HOOKS="0"))
    assert proc.returncode == 0, proc.stderr
    tr = load(str(out))
    assert is_zstd(str(out)) and tr.footer["digest"] and any(e["ev"] == "mark" for e in tr.events)


def _packed(tmp_path, frame_bytes: int) -> tuple[Any, Path, list]:
    """bench/gen_trace.py's 20k-event trace (every bug class) written as a seekable .zst with
    frames of ``frame_bytes``: (its loaded plain trace, the file, its seek table)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate

    plain = tmp_path / "big.jsonl"
    generate(str(plain), 20_000)
    tr = load(str(plain))
    packed = tmp_path / "big.jsonl.zst"
    old = compress.FRAME_BYTES
    compress.FRAME_BYTES = frame_bytes
    try:
        write_trace(str(packed), tr.header, [{k: v for k, v in e.items() if k != "block_ids_derived"} for e in tr.events],
                    {k: v for k, v in tr.footer.items() if k != "digest"})
    finally:
        compress.FRAME_BYTES = old
    return tr, packed, compress.seek_table(str(packed))


def _zero_frame(packed: Path, frames: list, k: int) -> Path:
    data = bytearray(packed.read_bytes())
    data[frames[k][0]:frames[k][0] + 8] = bytes(8)  # the frame's magic and header
    bad = packed.with_name(f"bad{k}.jsonl.zst")
    bad.write_bytes(bytes(data))
    return bad


def test_lenient_reads_on_after_a_damaged_frame_like_the_viewer(tmp_path):
    """A pdtrace .zst (seekable) with one damaged frame in the middle: `load --lenient`, `check
    --lenient` (one process and split) skip to the next frame, as the viewer's index does (same
    events, same problem line and wording); the findings citing an event after the gap are
    inconclusive, those before it are the intact trace's. Strict: one line naming the line."""
    from pdtrace.detectors.checking import check_file
    from pdtrace.index.trace_index import TraceIndex

    tr, packed, frames = _packed(tmp_path, 64 << 10)
    bad = _zero_frame(packed, frames, len(frames) // 2)
    got = load(str(bad), lenient=True)
    idx = TraceIndex(str(bad)).build()
    assert [(p.line, p.reason) for p in got.problems] == [(p.line, p.reason) for p in idx.problems]
    (gap,) = got.problems
    assert "uncompressed bytes lost (1 damaged zstd frame(s) and the lines they cut); first: corrupt zstd frame" in gap.reason
    assert got.events == list(idx.iter_events()) and got.footer == tr.footer
    ids = {e["id"] for e in got.events}
    assert ids < {e["id"] for e in tr.events} and got.events[-1]["id"] == tr.events[-1]["id"]
    first_lost = min({e["id"] for e in tr.events} - ids)  # (once: inside the generator it was rebuilt per id, 60 s)
    assert got.gap_after == max(i for i in ids if i < first_lost)
    whole = check_file(str(packed)).findings
    for jobs in (1, 2):
        c = check_file(str(bad), lenient=True, jobs=jobs)
        verdicts = [f for f in c.findings if f.severity != "inconclusive"]
        assert [(f.kind, f.req, f.step) for f in verdicts] == \
            [(f.kind, f.req, f.step) for f in whole if f.severity != "inconclusive" and max(f.event_ids) <= got.gap_after]
        assert any("after_gap" in (f.data or {}) for f in c.findings)
        assert all(c.coverage[k].status == "not-checked" for k in c.coverage)
    rc, out, err = _cli("check", bad)
    assert rc == 2 and err.count("\n") == 1 and f"{bad}:{gap.line}: " in err and "--lenient" in err, err
    rc, out, err = _cli("check", bad, "--lenient")
    assert rc == 1 and f"[INCOMPLETE: the compressed file is damaged at line {gap.line}: " in out
    assert "; the lines after it were read]" in out and "no footer" not in out + err
    html = tmp_path / "r.html"
    rc, out, err = _cli("report", bad, "--lenient", "-o", html)
    assert rc == 0 and "(after a damaged stretch)" in html.read_text(encoding="utf-8")


def test_a_damaged_last_frame_takes_the_footer_said_once(tmp_path):
    """The last frame damaged: the events before it are kept, the footer is lost with the gap,
    which says so (not also "no footer: the recording was cut off")."""
    tr, packed, frames = _packed(tmp_path, 64 << 10)
    bad = _zero_frame(packed, frames, len(frames) - 1)
    got = load(str(bad), lenient=True)
    assert got.footer is None and len(got.problems) == 1 and got.events == tr.events[:len(got.events)]
    rc, out, err = _cli("check", bad, "--lenient")
    assert f"[INCOMPLETE: the compressed file is damaged at line {got.problems[0].line}: " in out
    assert "no footer" not in out + err and "cut off" not in out + err and "damaged line(s)" not in out + err


def test_view_deletes_its_decompressed_copy(tmp_path):
    from pdtrace.commands.view import _remove_decompressed

    src = Path(__file__).resolve().parent.parent / "sample_traces" / "live_gpu_pd_eagle_v2.jsonl.zst"
    idx = open_source(str(src))
    copy = Path(idx.path)
    assert copy.exists() and copy.parent.name.startswith("pdtrace-view-")
    idx.close()
    _remove_decompressed(idx.path)
    assert not copy.parent.exists()
    _remove_decompressed(str(src))  # never anything outside a pdtrace-view-* temp dir
    assert src.exists()


def _frames_pair(tmp_path, monkeypatch, frame_bytes: int) -> tuple[Path, Path]:
    from pdtrace.tracefile import compress
    monkeypatch.setattr(compress, "FRAME_BYTES", frame_bytes)
    return _pair(tmp_path)


def test_compressed_traces_are_in_zstds_seekable_format(tmp_path, monkeypatch):
    """Independent frames of FRAME_BYTES uncompressed bytes and a seek table (zstd's
    contrib/seekable_format) in a skippable frame: each frame decompresses alone to its slice
    of the plain lines, and libzstd reading across frames gives exactly those lines."""
    from pdtrace.tracefile.compress import read_frame, seek_table
    plain, packed = _frames_pair(tmp_path, monkeypatch, 4096)
    table = seek_table(str(packed))
    data = plain.read_bytes()
    assert table is not None and len(table) == -(-len(data) // 4096) >= 5
    at = 0
    for frame in table:
        chunk = read_frame(str(packed), frame)
        assert chunk == data[at:at + frame[2]] and len(chunk) == frame[2]
        at += frame[2]
    assert at == len(data)
    reader = zstandard.ZstdDecompressor().stream_reader(packed.read_bytes(), read_across_frames=True)
    assert reader.read() == data
    assert seek_table(str(plain)) is None


def test_info_reads_only_the_last_frame_of_a_compressed_trace(tmp_path, monkeypatch):
    """`info` in constant time on a .zst (issue 22's < 1 s at any size): the footer from the
    last frame(s), back to the one where the footer line starts."""
    from pdtrace.tracefile import ends
    from pdtrace.tracefile.compress import seek_table
    real = ends.read_frame
    for frame_bytes in (1 << 20, 64):  # the footer in one frame / over several
        plain, packed = _frames_pair(tmp_path, monkeypatch, frame_bytes)
        calls = []
        monkeypatch.setattr(ends, "read_frame", lambda p, f: calls.append(f) or real(p, f))
        assert read_ends(str(packed))[1] == read_ends(str(plain))[1] is not None
        footer_frames = -(-(len(plain.read_bytes().splitlines()[-1]) + 1) // frame_bytes)
        assert footer_frames <= len(calls) <= footer_frames + 1 < len(seek_table(str(packed))) or frame_bytes > 64
        assert len(calls) == 1 or frame_bytes == 64


def test_info_on_a_compressed_trace_without_a_seek_table(tmp_path):
    """Another tool's single zstd stream, or a seek table that does not add up: read
    through to the end, the same footer."""
    plain, packed = _pair(tmp_path)
    single = tmp_path / "single.jsonl.zst"
    single.write_bytes(zstandard.ZstdCompressor(level=3).compress(plain.read_bytes()))
    from pdtrace.tracefile.compress import seek_table
    assert seek_table(str(single)) is None
    want = read_ends(str(plain))[1]
    assert read_ends(str(single))[1] == want
    for where in (-9, -13):  # the frame count; the last entry's decompressed size
        odd = tmp_path / f"odd{-where}.jsonl.zst"
        data = bytearray(packed.read_bytes())
        data[where] ^= 0xFF  # (the table is in a skippable frame: decoders still pass over it)
        odd.write_bytes(bytes(data))
        assert (seek_table(str(odd)) is None) == (where == -9)
        assert read_ends(str(odd))[1] == want
        assert load(str(odd)).events == load(str(plain)).events
