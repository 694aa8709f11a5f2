"""Bad input gets a clear error naming the line, and --lenient keeps every valid event."""

import orjson
import pytest

from pdtrace import schema
from pdtrace.errors import TraceError
from pdtrace.trace import load, make_footer, make_header, write_trace


def _events(n=5):
    return [{"ev": "mark", "t": i, "w": 1000 + i, "pid": 1, "role": "main", "inst": "-", "label": f"m{i}"}
            for i in range(n)]


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.jsonl"
    write_trace(str(p), make_header(origin="synthetic", versions={}), _events())
    return p


def test_roundtrip(good):
    tr = load(str(good))
    assert [e["label"] for e in tr.events] == ["m0", "m1", "m2", "m3", "m4"]
    assert [e["id"] for e in tr.events] == [0, 1, 2, 3, 4]
    assert tr.footer["counts"] == {"mark": 5} and tr.complete


def test_truncated_last_line_names_the_line(good):
    raw = good.read_bytes().splitlines(keepends=True)
    cut = b"".join(raw[:-1])[:-20]  # drop the footer and cut event 5 mid-line
    good.write_bytes(cut)
    with pytest.raises(TraceError) as ei:
        load(str(good))
    assert ei.value.line == 6 and "truncated" in ei.value.reason
    tr = load(str(good), lenient=True)
    assert [e["label"] for e in tr.events] == ["m0", "m1", "m2", "m3"]
    assert [str(p) for p in tr.problems][0].startswith("line 6: truncated")
    assert any("no footer" in p.reason for p in tr.problems)


def test_corrupt_line_names_the_line(good):
    lines = good.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"ev": "mark", "t": oops}\n'
    good.write_bytes(b"".join(lines))
    with pytest.raises(TraceError, match=r"good.jsonl:4: corrupt line"):
        load(str(good))
    tr = load(str(good), lenient=True)
    assert len(tr.events) == 4 and tr.footer is not None
    assert tr.problems[0].line == 4


def test_missing_field_and_unknown_kind(good):
    lines = good.read_bytes().splitlines(keepends=True)
    lines[1] = orjson.dumps({"ev": "mark", "t": 0, "w": 0, "pid": 1, "role": "main", "inst": "-"}) + b"\n"
    lines[2] = orjson.dumps({"ev": "warp.drive", "t": 0, "w": 0, "pid": 1, "role": "main", "inst": "-"}) + b"\n"
    good.write_bytes(b"".join(lines))
    with pytest.raises(TraceError, match=r":2: mark: missing field\(s\) label"):
        load(str(good))
    tr = load(str(good), lenient=True)
    assert [(p.line, p.reason) for p in tr.problems] == [
        (2, "mark: missing field(s) label"), (3, schema.new_kind_error("warp.drive"))]


def test_newer_schema_is_refused_but_lenient_reads_known_kinds(tmp_path):
    p = tmp_path / "new.jsonl"
    h = make_header(origin="synthetic", versions={})
    h["schema_version"] = schema.SCHEMA_VERSION + 1
    evs = _events(2) + [{"ev": "future.kind", "t": 9, "w": 9, "pid": 1, "role": "main", "inst": "-"}]
    write_trace(str(p), h, evs, make_footer(evs))
    with pytest.raises(TraceError) as ei:
        load(str(p))
    assert ei.value.line == 1 and "newer" in ei.value.reason
    tr = load(str(p), lenient=True)
    assert [e["ev"] for e in tr.events] == ["mark", "mark"]
    assert "newer" in tr.problems[0].reason


def test_foreign_and_empty_files(tmp_path):
    f = tmp_path / "f.jsonl"
    f.write_text('{"hello": "world"}\n')
    with pytest.raises(TraceError, match="not a pdtrace trace"):
        load(str(f))
    f.write_text("PK\x03\x04 binary")
    with pytest.raises(TraceError, match="line 1 is not JSON|:1: not a pdtrace"):
        load(str(f))
    f.write_text("")
    with pytest.raises(TraceError, match="empty file"):
        load(str(f))
    with pytest.raises(TraceError, match="cannot open"):
        load(str(tmp_path / "missing.jsonl"))


def test_check_cli_reports_the_line(good):
    """The CLI path: a user error message naming file:line and exit code 2 (no traceback)."""
    import subprocess
    import sys

    lines = good.read_bytes().splitlines(keepends=True)
    lines[2] = b"garbage\n"
    good.write_bytes(b"".join(lines))
    r = subprocess.run([sys.executable, "-m", "pdtrace", "info", str(good)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{good}:3: corrupt line" in r.stderr and "Traceback" not in r.stderr
