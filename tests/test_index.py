"""pdtrace.index.trace_index: the byte-offset line index agrees with pdtrace.tracefile.trace.load, reads lines
lazily, names bad lines like the loader, and keeps far less than the parsed events."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pdtrace.tracefile import trace as trace_mod
from pdtrace.errors import TraceError
from pdtrace.index.trace_index import TraceIndex
from pdtrace.index.shards import load_shards
from pdtrace.tracefile.trace import make_header, write_trace


def _events(n: int) -> list[dict]:
    out = []
    for i in range(n):
        inst = "P" if i % 3 else "D"
        e = {"ev": "sched.step", "t": 1000 + i, "w": 2000 + i, "pid": 7 if inst == "P" else 8,
             "role": "engine-core", "inst": inst, "step": i // 6, "num_reqs": 1, "num_tokens": 4,
             "tokens": {f"r{i % 5}": 4}}
        if i % 4 == 0:
            e = {"ev": "batch.add", "t": 1000 + i, "w": 2000 + i, "pid": 9, "role": "worker", "inst": inst,
                 "req": f"r{i % 5}", "row": i % 8}  # no step: takes the instance's last step
        out.append(e)
    return out


def _write(tmp_path: Path, n: int = 200) -> str:
    p = str(tmp_path / "t.jsonl")
    write_trace(p, make_header(origin="synthetic", versions={}), _events(n))
    return p


def test_index_matches_loader_and_reads_lazily(tmp_path):
    p = _write(tmp_path, 500)
    ref = trace_mod.load(p)
    idx = TraceIndex(p, lenient=False)
    progress = list(idx.scan(batch_time=0.0))  # one batch per chunk
    assert progress[-1].done and progress[-1].events == len(ref.events) == len(idx)
    assert idx.header == ref.header and idx.footer == ref.footer and idx.problems == []
    for i in (0, 1, 250, 499):
        assert idx.event(i) == ref.events[i]
    assert list(idx.iter_events()) == ref.events
    # columns: requests, effective steps (a step-less event takes its instance's last step)
    assert sorted(idx.req_names) == [f"r{k}" for k in range(5)]
    assert [ref.events[i]["req"] for i in idx.request_ordinals("r3")] == ["r3"] * len(idx.request_ordinals("r3"))
    e4 = ref.events[4]
    assert "step" not in e4 and idx.steps[4] == ref.events[2]["step"]  # event 2 is the last P step before 4
    ords = idx.step_ordinals(10, "P")
    assert ords and all(idx.steps[i] == 10 and idx.insts[i] == idx.inst_code["P"] for i in ords)
    assert idx.steps[0] == -1  # step-less event before any step on its instance
    assert idx.steps_of() == sorted({idx.steps[i] for i in range(len(idx))} - {-1})
    assert idx.memory_bytes() < Path(p).stat().st_size / 4


@pytest.mark.parametrize("lenient", [False, True])
def test_bad_lines_named_like_the_loader(tmp_path, lenient):
    p = Path(_write(tmp_path, 20))
    lines = p.read_bytes().splitlines(keepends=True)
    lines[3] = b"{not json\n"
    lines[5] = b'{"ev": "no.such.kind", "t": 1}\n'
    lines[7] = b'{"ev": "sched.step", "t": 1}\n'
    lines.append(b'{"ev": "sched.step", "t": 1')  # after the footer, truncated
    p.write_bytes(b"".join(lines))
    if not lenient:
        with pytest.raises(TraceError) as ei:
            TraceIndex(str(p), lenient=False).build()
        with pytest.raises(TraceError) as ref:
            trace_mod.load(str(p))
        assert (ei.value.line, ei.value.reason) == (ref.value.line, ref.value.reason) == (4, "corrupt line: not valid JSON")
        return
    idx = TraceIndex(str(p), lenient=True).build()
    ref = trace_mod.load(str(p), lenient=True)
    assert [(q.line, q.reason) for q in idx.problems] == [(q.line, q.reason) for q in ref.problems]
    assert [q.line for q in idx.problems] == [4, 6, 8, 23]
    assert list(idx.iter_events()) == ref.events


def test_foreign_and_empty_files(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    with pytest.raises(TraceError, match="empty file"):
        TraceIndex(str(tmp_path / "e.jsonl")).build()
    (tmp_path / "f.jsonl").write_bytes(b'{"hello": 1}\n')
    with pytest.raises(TraceError) as ei:
        TraceIndex(str(tmp_path / "f.jsonl")).build()
    assert ei.value.line == 1 and "not a pdtrace trace" in ei.value.reason


def test_shards_merge_sorted_by_time_with_problems(tmp_path):
    evs = _events(30)
    (tmp_path / "a.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in evs[::2]) + b"garbage\n")
    (tmp_path / "b.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in evs[1::2]))
    idx = load_shards(str(tmp_path))
    got = list(idx.iter_events())
    assert [e["t"] for e in got] == [e["t"] for e in evs]
    assert [e["id"] for e in got] == list(range(30))
    assert [(q.line, q.reason) for q in idx.problems] == [(16, "a.jsonl: corrupt line: not valid JSON")]


def test_shard_directory_written_by_recorders_opens_in_the_index(tmp_path):
    """Real shard files (marshal frames) from two recorders, as `pdtrace view DIR` opens them."""
    from pdtrace.record.recorder import Recorder

    a = Recorder.to_shard_dir(str(tmp_path), threaded=False, inst="P")
    a.pid = 111  # two processes' shards in one directory
    a.shard_path, a._fh = str(tmp_path / "111.pdshard"), open(tmp_path / "111.pdshard", "ab", buffering=0)
    b = Recorder.to_shard_dir(str(tmp_path), threaded=False, inst="D")
    for i in range(3):
        a.emit("mark", label=f"p{i}")
        b.emit("mark", label=f"d{i}")
    a.flush()  # (a.close() is a no-op: a recorder whose pid is not this process's came through fork)
    b.close()
    idx = load_shards(str(tmp_path))
    got = list(idx.iter_events())
    assert [e["label"] for e in got if e["ev"] == "mark"] == ["p0", "d0", "p1", "d1", "p2", "d2"]
    assert {e["inst"] for e in got} == {"P", "D"} and idx.problems == []
