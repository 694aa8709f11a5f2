"""Recorder under faults (issue 20): nothing is lost without being counted.

Real shard files and a real writer thread; the footer is built by the same merge that
`pdtrace record` runs (``shards.finalize_session``)."""

from __future__ import annotations

import threading

from pdtrace.record.recorder import Recorder
from pdtrace.record.shards import finalize_session
from pdtrace.tracefile.trace import load


def test_storm_with_a_small_queue_counts_every_drop(tmp_path):
    """Two threads emit far faster than a 64-slot queue drains: proc.exit (which carries the
    drop count) must still reach the shard, and footer ``dropped`` == emitted - written."""
    shard_dir = tmp_path / "shards"
    rec = Recorder.to_shard_dir(str(shard_dir), max_queue=64, flush_interval=0.05)
    per_thread = 100_000

    def storm(name):
        emit = rec.emit
        for i in range(per_thread):
            emit("mark", label=name, detail=str(i))

    threads = [threading.Thread(target=storm, args=(f"t{k}",)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    out = tmp_path / "t.jsonl"
    footer, problems = finalize_session(str(shard_dir), str(out), cmd=["storm"], redacted=True, exit_code=0)
    assert not problems
    tr = load(str(out))  # strict: a valid trace
    written = sum(1 for e in tr.events if e["ev"] == "mark")
    emitted = 2 * per_thread
    assert 0 < written < emitted  # the storm really overflowed the queue
    assert footer["dropped"] == emitted - written > 0
    (exit_ev,) = [e for e in tr.events if e["ev"] == "proc.exit"]
    assert exit_ev["dropped"] == emitted - written
    assert exit_ev["events"] == written + 1  # what the process wrote, proc.exit included
    assert footer["processes"][0]["complete"] is True and footer["processes"][0]["dropped"] == emitted - written
