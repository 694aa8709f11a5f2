"""Crash-safe shards (issue 20): short writes, a disk that fills mid-run, damaged frames.

A shard is a sequence of frames (magic, length, event count, crc32, payload). The writer
loops over short writes and cuts a failed frame back off; the reader skips any damaged
stretch, resynchronises on the next intact frame and counts what it skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import small_tmpfs

from pdtrace.record.recorder import FRAME_HEAD, Recorder
from pdtrace.record.shards import finalize_session, read_shard
from pdtrace.tracefile.trace import load


def _three_frames(tmp_path):
    rec = Recorder.to_shard_dir(str(tmp_path / "s"), threaded=False)
    for label, n in (("a", 3), ("b", 4), ("c", 5)):
        for i in range(n):
            rec.emit("mark", label=label, detail=str(i))
        rec.flush()
    data = Path(rec.shard_path).read_bytes()
    frames, pos = [], 0
    while pos < len(data):
        _m, length, count, _crc, _hcrc = FRAME_HEAD.unpack_from(data, pos)
        frames.append(data[pos:pos + FRAME_HEAD.size + length])
        pos += FRAME_HEAD.size + length
    assert [FRAME_HEAD.unpack_from(f)[2] for f in frames] == [3, 4, 5]
    return rec.shard_path, frames


def _labels(events):
    return [e["label"] for e in events if e["ev"] == "mark"]


def test_every_intact_frame_after_damage_is_recovered(tmp_path):
    path, (a, b, c) = _three_frames(tmp_path)
    flipped = bytearray(c)
    flipped[-3] ^= 0xFF  # a bit rot in the payload: the checksum catches it
    # a half-written b (a failed write that could not be cut back), garbage, b, a rotten c,
    # 10 bytes of a header, c, and a last frame cut short (SIGKILL mid-write)
    damaged = a + b[: len(b) // 2] + b"\x00garbage\xff" + b + bytes(flipped) + c[:10] + c + a[:-3]
    Path(path).write_bytes(damaged)
    events, problems = read_shard(path)
    assert _labels(events) == ["a"] * 3 + ["b"] * 4 + ["c"] * 5  # a, b, c: every intact frame
    reasons = [p.reason for p in problems]
    assert len(problems) == 4, reasons
    assert "checksum mismatch" in reasons[0] and "4 event(s) lost" in reasons[0]
    assert "read on from the next frame" in reasons[0]
    assert "checksum mismatch" in reasons[1] and "5 event(s) lost" in reasons[1]
    assert "damaged frame header" in reasons[2] and "lost" not in reasons[2]  # a count it cannot trust
    assert "truncated" in reasons[3] and "3 event(s) lost" in reasons[3]
    assert [p.lost for p in problems] == [4, 5, 0, 3]


def test_short_writes_are_completed(tmp_path):
    """A file object whose write() takes at most 7 bytes at a time (what a pipe, a signal or a
    nearly full disk can do): every frame still lands whole."""
    rec = Recorder.to_shard_dir(str(tmp_path), threaded=False)
    real = rec._fh

    class Short:
        def write(self, b):
            return real.write(bytes(b[:7]))

        def __getattr__(self, name):
            return getattr(real, name)

    rec._fh = Short()
    for i in range(50):
        rec.emit("mark", label="x", detail=str(i))
    rec.flush()
    events, problems = read_shard(rec.shard_path)
    assert problems == [] and len(_labels(events)) == 50 and rec.dropped == 0


def test_failed_write_is_cut_back_and_counted(tmp_path):
    """ENOSPC after part of a frame was written: the partial frame is cut off the shard, the
    batch is counted as dropped, and the next frames land whole after the good ones."""
    rec = Recorder.to_shard_dir(str(tmp_path / "s"), threaded=False)
    real = rec._fh
    state = {"fail": False}

    class Filling:
        def write(self, b):
            if state["fail"]:
                n = real.write(bytes(b[:10]))  # some bytes fit, then the disk is full
                if n < len(b):
                    raise OSError(28, "No space left on device")
            return real.write(b)

        def __getattr__(self, name):
            return getattr(real, name)

    rec._fh = Filling()
    rec.emit("mark", label="before")
    rec.flush()
    state["fail"] = True
    for _ in range(3):
        rec.emit("mark", label="during")
    rec.flush()
    state["fail"] = False
    rec.emit("mark", label="after")
    rec.close()
    events, problems = read_shard(rec.shard_path)
    assert problems == []  # the cut frame was removed, not left for the reader to skip
    assert _labels(events) == ["before", "after"]
    (ex,) = [e for e in events if e["ev"] == "proc.exit"]
    assert ex["dropped"] == 3



# A recorded program that fills its disk for a moment: 500 marks, disk full, 500 marks,
# disk freed, 500 marks.
FILL = r"""
import os, sys, time
from pdtrace.record import recorder
r = recorder.get()
disk = sys.argv[1]
def burst(label):
    for i in range(500):
        r.emit('mark', label=label, detail='x' * 40 + str(i))
    time.sleep(0.6)  # several flush intervals
burst('before')
filler = os.path.join(disk, 'filler')
fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
chunk = 1 << 16
while chunk:
    try:
        os.write(fd, b'\0' * chunk)
    except OSError:
        chunk //= 2
os.close(fd)
burst('during')
os.unlink(filler)
burst('after')
"""


def test_disk_full_mid_run_recovers_every_event_after_the_fault(tmp_path):
    prog = tmp_path / "fill.py"
    prog.write_text(FILL)
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        out = disk / "t.jsonl"
        r = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(out), "--flush-interval", "0.05",
                            "--", sys.executable, str(prog), str(disk)], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PDTRACE_HOOKS="0"))
        assert r.returncode == 0, r.stderr
        assert "No space left on device" in r.stderr and "writes again" in r.stderr  # said once each
        tr = load(str(out))
    labels = _labels(tr.events)
    during = labels.count("during")
    assert labels.count("before") == 500 and labels.count("after") == 500
    assert during < 500
    assert tr.footer["dropped"] == 500 - during > 0  # the disk-full spell, counted
    assert tr.footer.get("shard_problems") is None
    assert all(p["complete"] for p in tr.footer["processes"])


def test_lost_events_of_damaged_frames_reach_the_footer(tmp_path):
    path, (a, b, c) = _three_frames(tmp_path)
    Path(path).write_bytes(a + b[:-2] + c)  # frame b cut short in the middle of the file
    footer, problems = finalize_session(os.path.dirname(path), str(tmp_path / "t.jsonl"), cmd=[], redacted=True,
                                        exit_code=0)
    assert footer["lost"] == 4 and len(footer["shard_problems"]) == 1
    assert footer["counts"]["mark"] == 8
