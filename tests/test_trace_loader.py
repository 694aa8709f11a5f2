"""Bad input gets a clear error naming the line, and --lenient keeps every valid event."""

import orjson
import pytest

from pdtrace import schema
from pdtrace.errors import TraceError
from pdtrace.tracefile.trace import load, make_footer, make_header, write_trace


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
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(good)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{good}:3: corrupt line" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- what the fast path records

def _alloc(i, req, block_ids=None, new=None, ok=True):
    e = {"ev": "sched.alloc", "t": i, "w": 1000 + i, "pid": 2, "role": "engine-core", "inst": "D",
         "req": req, "ok": ok, "new_block_ids": [new or []], "num_computed_tokens": 0,
         "num_new_tokens": 1, "num_lookahead_tokens": 0}
    if block_ids is not None:
        e["block_ids"] = [block_ids]
    return e


def test_loaded_events_carry_groups_codes_and_aligned_ids(tmp_path):
    from pdtrace.tracefile.trace import EventList, kind_groups, select_kinds

    p = tmp_path / "t.jsonl"
    evs = _events(3) + [_alloc(9, "r1", [1, 2])] + _events(2)
    write_trace(str(p), make_header(origin="synthetic", versions={}), evs)
    tr = load(str(p))
    assert isinstance(tr.events, EventList) and isinstance(tr.events, list)
    groups = kind_groups(tr.events)
    assert groups == {"mark": [e for e in tr.events if e["ev"] == "mark"],
                      "sched.alloc": [e for e in tr.events if e["ev"] == "sched.alloc"]}
    assert tr.events.ids_aligned and [e["id"] for e in tr.events] == list(range(6))
    picked, codes = select_kinds(tr.events, ["sched.alloc", "mark"], with_codes=True)
    assert picked == list(tr.events) and len(codes) == 6 and len(set(codes)) == 2
    assert select_kinds(tr.events, ["sched.alloc"]) == [tr.events[3]]
    tr.events.append(dict(tr.events[0]))  # edited in place: the extras no longer describe it
    assert kind_groups(tr.events) is None and select_kinds(tr.events, ["mark"]) is None


def test_ids_from_the_file_that_are_not_positions(tmp_path):
    from pdtrace.tracefile.trace import select_kinds

    p = tmp_path / "t.jsonl"
    evs = _events(4)
    for i, e in enumerate(evs):
        e["id"] = 100 - i  # kept as written, but trace order by id is no longer list order
    write_trace(str(p), make_header(origin="synthetic", versions={}), evs, assign_ids=False)
    tr = load(str(p))
    assert [e["id"] for e in tr.events] == [100, 99, 98, 97]
    assert not tr.events.ids_aligned and select_kinds(tr.events, ["mark"]) is None


def test_schema_v2_allocs_derived_once(tmp_path):
    from pdtrace.tracefile.trace import derive_block_lists

    p = tmp_path / "t.jsonl"
    evs = [_alloc(0, "r1", [1, 2], [1, 2]), _alloc(1, "r1", None, [3]), _alloc(2, "r1", None, [])]
    write_trace(str(p), make_header(origin="synthetic", versions={}), evs)
    tr = load(str(p))
    allocs = [e for e in tr.events if e["ev"] == "sched.alloc"]
    assert [e["block_ids"] for e in allocs] == [[[1, 2]], [[1, 2, 3]], [[1, 2, 3]]]
    assert [e.get("block_ids_derived", False) for e in allocs] == [False, True, True]
    assert tr.events.blocks_derived and derive_block_lists(tr.events) == 0  # done once, by load
    # a plain list of the same events (as a caller may build) is derived again, the same way
    plain = [dict(e) for e in tr.events]
    assert derive_block_lists(plain) == 2 and [e["block_ids"] for e in plain] == [e["block_ids"] for e in allocs]
    # nothing to derive: the loader says so without a pass, and nothing is marked derived
    q = tmp_path / "full.jsonl"
    write_trace(str(q), make_header(origin="synthetic", versions={}), [_alloc(0, "r1", [1]), _alloc(1, "r1", [1, 2])])
    tr2 = load(str(q))
    assert tr2.events.blocks_derived and not any("block_ids_derived" in e for e in tr2.events)


def test_load_leaves_the_gc_as_it_found_it(good):
    import gc

    assert gc.isenabled()
    load(str(good))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        load(str(good))
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()  # a process that froze objects itself keeps them frozen
    try:
        n = gc.get_freeze_count()
        load(str(good))
        assert gc.get_freeze_count() == n
    finally:
        gc.unfreeze()


def test_bad_lines_after_a_clean_start_fall_back_to_the_exact_scan(good):
    lines = good.read_bytes().splitlines(keepends=True)
    bad = orjson.loads(lines[4])
    del bad["label"]
    lines[4] = orjson.dumps(bad) + b"\n"
    lines.append(lines[2])  # and data after the footer
    good.write_bytes(b"".join(lines))
    with pytest.raises(TraceError, match=r":5: mark: missing field\(s\) label"):
        load(str(good))
    tr = load(str(good), lenient=True)
    assert [(p.line, p.reason) for p in tr.problems] == [
        (5, "mark: missing field(s) label"), (8, "data after the footer")]
    assert [e["label"] for e in tr.events] == ["m0", "m1", "m2", "m4"]


# ------------------------------------------------ the fast loader parses runs of lines at once

@pytest.mark.parametrize("line, reason", [
    (b'{"ev": "mark", "t": 1, "w": 1, "pid": 1, "role": "main", "inst": "-", "label": "a"},'
     b'{"ev": "mark", "t": 2, "w": 2, "pid": 1, "role": "main", "inst": "-", "label": "b"}\n', "corrupt line"),
    (b"\n", "blank line"),
    (b"[1, 2]\n", "corrupt line: not a JSON object"),
])
def test_a_run_parse_never_accepts_what_a_line_parse_rejects(good, line, reason):
    """The fast loader parses many lines as one JSON array; a line with two values joined by
    a comma, a blank line or a non-object must still be refused with its own line number."""
    lines = good.read_bytes().splitlines(keepends=True)
    lines[3] = line
    good.write_bytes(b"".join(lines))
    with pytest.raises(TraceError) as ei:
        load(str(good))
    assert ei.value.line == 4 and reason in ei.value.reason


def test_runs_that_split_lines_anywhere_give_the_same_events(tmp_path, monkeypatch):
    """Runs of a few bytes (every line completed from the next run) and one run for the
    whole file load the same events, progress included, as the exact line scan."""
    from pdtrace.tracefile import segments, trace as T

    p = tmp_path / "t.jsonl"
    write_trace(str(p), make_header(origin="synthetic", versions={}), _events(40))
    expected = [e for what, _l, e in T.scan(str(p)) if what == "event"]
    for chunk in (1, 7, 100, 1 << 20):
        monkeypatch.setattr(segments, "_CHUNK", chunk)
        seen = []
        tr = T._load_fast(str(p), lambda pos, total: seen.append((pos, total)))
        assert tr is not None and list(tr.events) == expected and tr.footer["events"] == 40
        assert seen[-1] == (p.stat().st_size,) * 2 and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))
