"""`record`'s streaming shard merge (``shards.finalize_session``) against the in-memory merge
(``shards.merge_shard_dir``: every shard read whole, stably sorted by time, heap-merged).

Shards come from the real recorder (several threads of one process emitting at once, so a
shard's frames hold events a little out of time order) and from hand-written frames whose
events arrive up to 5 ms late, plus a damaged frame in the middle; the streamed trace must
hold the same events in the same order, and the same problems.
"""

from __future__ import annotations

import marshal
import os
import threading
import zlib

import orjson

from pdtrace.record.frames import SHARD_SUFFIX, frame_head
from pdtrace.record.recorder import Recorder
from pdtrace.record.shards import finalize_session, in_time_order, merge_shard_dir

VOLATILE = ("id",)


def _written(path):
    with open(path, "rb") as fh:
        lines = [orjson.loads(x) for x in fh]
    return lines[0], lines[1:-1], lines[-1]


def _strip(evs):
    return [{k: v for k, v in e.items() if k not in VOLATILE} for e in evs]


def _late_shard(path, pid, n, late_every=7, late_ns=5_000_000):
    meta = (pid, "worker", "D", 0, 1_000)
    with open(path, "wb") as fh:
        for start in range(0, n, 50):
            items = []
            for i in range(start, min(start + 50, n)):
                t = 1_000_000 + i * 10_000 + pid - (late_ns if i % late_every == 0 else 0)
                items.append(("mark", t, None, None, {"label": f"{pid}-{i}"}))
            body = marshal.dumps((meta, items), 4)
            fh.write(frame_head(len(body), len(items), zlib.crc32(body)) + body)
            if start == 500:  # a damaged frame: its checksum does not hold
                bad = marshal.dumps((meta, [("mark", 1, None, None, {"label": "lost"})]), 4)
                fh.write(frame_head(len(bad), 1, zlib.crc32(bad) ^ 1) + bad)


def test_streamed_merge_equals_the_in_memory_merge(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    _late_shard(str(d / f"101{SHARD_SUFFIX}"), 101, 1200)
    _late_shard(str(d / f"102{SHARD_SUFFIX}"), 102, 900, late_every=3, late_ns=2_000_000)
    # a real recorder, four threads emitting at once (its own pid; flushed in small batches)
    rec = Recorder.to_shard_dir(str(d), flush_interval=0.001)

    def burst(k):
        for i in range(2000):
            rec.emit("mark", label=f"thread{k}-{i}")

    threads = [threading.Thread(target=burst, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()

    expected, expected_problems = merge_shard_dir(str(d))
    out = tmp_path / "t.jsonl"
    footer, problems = finalize_session(str(d), str(out), cmd=["x"], redacted=True, exit_code=3)
    header, events, written_footer = _written(out)
    assert _strip(events) == _strip(expected)
    assert [e["id"] for e in events] == list(range(len(events)))
    ts = [e["t"] for e in events]
    assert ts == sorted(ts)
    assert [str(p) for p in problems] == [str(p) for p in expected_problems] and len(problems) == 2
    assert written_footer == footer and footer["events"] == len(events)
    assert footer["counts"]["mark"] == 1200 + 900 + 8000
    assert footer["lost"] == 2 and footer["exit_code"] == 3 and header["instances"] == ["D"]


def test_time_order_buffer_releases_what_no_later_event_can_precede():
    evs = [{"t": t} for t in (10, 30, 20, 40, 25, 50, 60, 45, 70)]  # at most 15 late
    seen = 0

    def source():
        nonlocal seen
        for e in evs:
            seen += 1
            yield e

    released = []  # (t, how many events the source had handed over when it was released)
    for e in in_time_order(source(), lateness=15):
        released.append((e["t"], seen))
    assert [t for t, _ in released] == sorted(e["t"] for e in evs)
    # 10 goes once 30 (> 10 + 15) has arrived, not at the end: the buffer does not hold everything
    assert released[0] == (10, 2)
