"""Typed loading (issue 20): the schema declares each field's type, the loader checks it,
names the line and the field, and ``--lenient`` skips and counts the event."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdtrace.errors import TraceError
from pdtrace.index.trace_index import TraceIndex
from pdtrace.tracefile.trace import load

SAMPLE = Path(__file__).resolve().parent.parent / "pdtrace/samples/demo_lookahead_misalignment.jsonl"


def _with(tmp_path, line_no: int, edit) -> Path:
    lines = SAMPLE.read_text().splitlines()
    obj = json.loads(lines[line_no - 1])
    edit(obj)
    lines[line_no - 1] = json.dumps(obj)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("version", [0, -1, True, "2", None, 2.0])
def test_bad_schema_versions_are_refused(tmp_path, version):
    p = _with(tmp_path, 1, lambda h: h.__setitem__("schema_version", version))
    with pytest.raises(TraceError) as ei:
        load(str(p), lenient=True)
    assert ei.value.line == 1 and "schema_version must be a positive integer" in ei.value.reason


def _first(kind):
    for n, ln in enumerate(SAMPLE.read_text().splitlines(), 1):
        if json.loads(ln)["ev"] == kind:
            return n
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, field, value, expect", [
    pytest.param("sched.alloc", "ok", "yes", "sched.alloc: field 'ok' should be bool, got string"),
    pytest.param("sched.alloc", "num_new_tokens", True, "field 'num_new_tokens' should be int, got boolean"),
    pytest.param("sched.alloc", "new_block_ids", [[1, "2"]], "field 'new_block_ids' should be list[list[int]], got list"),
    pytest.param("sched.alloc", "step", "7", "field 'step' should be int, got string"),  # optional common field
    ("sched.alloc", "ev", ["sched.alloc"], "'ev' should be a string"),
])
def test_wrong_typed_field_names_line_and_field(tmp_path, kind, field, value, expect):
    line = _first(kind)
    p = _with(tmp_path, line, lambda o: o.__setitem__(field, value))
    with pytest.raises(TraceError) as ei:
        load(str(p))
    assert ei.value.line == line and expect in ei.value.reason
    tr = load(str(p), lenient=True)  # skipped and counted
    assert [(q.line, expect in q.reason) for q in tr.problems] == [(line, True)]
    assert len(tr.events) == len(load(str(SAMPLE)).events) - 1
    idx = TraceIndex(str(p), lenient=True).build()  # the TUI's loader agrees
    assert [(q.line, expect in q.reason) for q in idx.problems] == [(line, True)]


def test_wrong_typed_footer_is_a_problem(tmp_path):
    n = len(SAMPLE.read_text().splitlines())
    p = _with(tmp_path, n, lambda f: f.__setitem__("hooks", {"applied": True}))
    with pytest.raises(TraceError) as ei:
        load(str(p))
    assert ei.value.line == n and "footer: field 'hooks'" in ei.value.reason
    tr = load(str(p), lenient=True)
    assert tr.footer is None and tr.problems[0].line == n


# --- the footer digest: the writer type-checks, a reader whose bytes match skips its checks ---

def _rewrite(src: Path, dst: Path, edit=None) -> dict:
    """``src`` written again through pdtrace's writer (``write_trace``), an event edited first."""
    from pdtrace.tracefile.trace import write_trace

    tr = load(str(src))
    events = [{k: v for k, v in e.items() if k != "block_ids_derived"} for e in tr.events]
    if edit is not None:
        edit(events)
    footer = {k: v for k, v in tr.footer.items() if k != "digest"}
    return write_trace(str(dst), tr.header, events, footer)


def test_writer_signs_a_valid_trace_and_the_reader_trusts_it(tmp_path, monkeypatch):
    from pdtrace.tracefile import trace

    dst = tmp_path / "signed.jsonl"
    footer = _rewrite(SAMPLE, dst)
    lines = dst.read_bytes().splitlines(keepends=True)
    import zlib
    assert footer["digest"] == "crc32:%08x" % zlib.crc32(b"".join(lines[1:-1]))
    assert json.loads(lines[-1])["digest"] == footer["digest"]

    n_events = len(load(str(SAMPLE)).events)

    def no_checks(events):  # a matching digest: the loader must not type-check again
        raise AssertionError("type-checked a trace whose digest matched")
    monkeypatch.setattr(trace, "_all_valid", no_checks)
    assert len(load(str(dst)).events) == n_events


def test_a_wrong_type_in_a_signed_trace_is_still_named(tmp_path):
    """A hand edit after signing: the digest no longer matches, so every event is checked."""
    dst = tmp_path / "signed.jsonl"
    _rewrite(SAMPLE, dst)
    lines = dst.read_text().splitlines()
    n = next(i for i, ln in enumerate(lines, 1) if json.loads(ln)["ev"] == "sched.alloc")
    obj = json.loads(lines[n - 1])
    obj["num_new_tokens"] = "16"
    lines[n - 1] = json.dumps(obj, separators=(",", ":"))
    dst.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as ei:
        load(str(dst))
    assert ei.value.line == n and "field 'num_new_tokens' should be int, got string" in ei.value.reason


def test_writer_leaves_the_digest_out_when_an_event_is_invalid(tmp_path):
    """A hook that emitted a wrong type: the event is written (nothing lost) but unsigned, and
    the reader names it."""
    dst = tmp_path / "bad.jsonl"

    def spoil(events):
        e = next(e for e in events if e["ev"] == "sched.alloc")
        e["new_block_ids"] = [[1, True]]
    footer = _rewrite(SAMPLE, dst, spoil)
    assert "digest" not in footer
    with pytest.raises(TraceError) as ei:
        load(str(dst))
    assert "field 'new_block_ids' should be list[list[int]], got list" in ei.value.reason
    assert len(load(str(dst), lenient=True).events) == len(load(str(SAMPLE)).events) - 1


@pytest.mark.parametrize("field, value", [
    ("new_block_ids", [[1, True]]),     # a boolean among block ids
    ("block_ids", [[1], "2"]),          # a group that is not a list
    ("step", None),                     # an optional field may be null ...
])
def test_nested_and_null_values(tmp_path, field, value):
    line = _first("sched.alloc")
    p = _with(tmp_path, line, lambda o: o.__setitem__(field, value))
    if value is None:  # ... and then loads
        assert len(load(str(p)).events) == len(load(str(SAMPLE)).events)
        return
    with pytest.raises(TraceError) as ei:
        load(str(p))
    assert ei.value.line == line and f"field {field!r}" in ei.value.reason


def _refused(tmp_path, edit, expect: str) -> None:
    """The first sched.alloc edited: strict loading names its line and ``expect``."""
    line = _first("sched.alloc")
    p = _with(tmp_path, line, edit)
    with pytest.raises(TraceError) as ei:
        load(str(p))
    assert ei.value.line == line and expect in ei.value.reason


def test_a_required_field_may_not_be_null(tmp_path):
    _refused(tmp_path, lambda o: o.__setitem__("ok", None), "field 'ok' should be bool, got null")


def test_a_per_request_event_without_its_request_is_named(tmp_path):
    """``req: null`` on a sched.alloc once made the real finding vanish; now it is refused."""
    _refused(tmp_path, lambda o: o.__setitem__("req", None), "field 'req' should be str, got null")
    _refused(tmp_path, lambda o: o.pop("req"), "missing field(s) req")
