"""Flight-recorder shards (``pdtrace record --ring SECONDS``, issue 22): keep about the last
SECONDS of each process's events on disk, whatever the length of the run.

A process writes its frames into segment files ``<pid>.<n>.pdshard``; a new segment starts
every quarter of the window, and a segment whose last write is older than the window is
deleted with its events counted (``discarded``; ``proc.exit`` carries the count and the
footer sums it). Events that describe the process rather than a moment -- its start, role,
hooks, scheduler config, model runner -- go to ``<pid>.pinned.pdshard``, never deleted: the
detectors need them to judge what the window kept. The merge reads segment files as it reads
any shard (``pdtrace.record.shards``); the trace's header says the window (``ring_s``) and its footer
how many events were discarded.

Disk use is bounded by the event rate times 1.25 windows per process. The writer thread does
the rotation; ``emit()`` on the caller's thread is unchanged.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable

from .frames import FRAME_HEAD, SHARD_SUFFIX, write_frame

# kinds emitted once per process or per engine that the detectors read to judge later events
PINNED_KINDS = frozenset({"proc.start", "proc.role", "hooks.status", "sched.config", "runner", "acc.device"})


class SegmentRing:
    """The shard files of one process in ring mode (the writer thread's sink)."""

    def __init__(self, directory: str, pid: int, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.directory = directory
        self.pid = pid
        self.seconds = float(seconds)
        self.span = max(self.seconds / 4, 0.05)
        self.clock = clock
        self.discarded = 0  # events in deleted segments
        self.frozen = False  # set at exit: no more rotation or deletion
        self._n = 0
        self._segments: collections.deque[list[Any]] = collections.deque()  # [path, fh, opened, last, events]
        self.pinned = open(os.path.join(directory, f"{pid}.pinned{SHARD_SUFFIX}"), "ab", buffering=0)
        self._open_segment(clock())

    def _open_segment(self, now: float) -> None:
        path = os.path.join(self.directory, f"{self.pid}.{self._n:06d}{SHARD_SUFFIX}")
        self._n += 1
        self._segments.append([path, open(path, "ab", buffering=0), now, now, 0])

    def write(self, frame: bytes, pinned: bool = False) -> None:
        if pinned:
            write_frame(self.pinned, frame)
            return
        now = self.clock()
        cur = self._segments[-1]
        if now - cur[2] >= self.span and not self.frozen:
            cur[1].close()
            self._open_segment(now)
            cur = self._segments[-1]
        write_frame(cur[1], frame)
        cur[3] = now
        cur[4] += FRAME_HEAD.unpack_from(frame)[2]  # the frame's event count
        while not self.frozen and len(self._segments) > 1 and self._segments[0][3] < now - self.seconds:
            path, fh, _opened, _last, events = self._segments.popleft()
            fh.close()
            try:
                os.unlink(path)
            except OSError:
                pass
            self.discarded += events

    def close(self) -> None:
        for seg in self._segments:
            try:
                seg[1].close()
            except OSError:
                pass
        try:
            self.pinned.close()
        except OSError:
            pass


def copy_for_snapshot(shard_dir: str, dest: str) -> int:
    """Copy a live recording's shard files into ``dest`` for a snapshot trace, each cut back to
    its last whole frame (a writer may be mid-frame; segments may vanish while we copy: those
    are skipped). Returns how many files were copied."""
    import glob
    import shutil

    n = 0
    for src in sorted(glob.glob(os.path.join(shard_dir, "*" + SHARD_SUFFIX))):
        dst = os.path.join(dest, os.path.basename(src))
        try:
            shutil.copyfile(src, dst)
        except FileNotFoundError:  # rotated out just now
            continue
        _cut_to_whole_frames(dst)
        n += 1
    return n


def _cut_to_whole_frames(path: str) -> None:
    from .frames import SHARD_MAGIC

    size = os.path.getsize(path)
    pos = 0
    with open(path, "r+b") as fh:
        while pos < size:
            fh.seek(pos)
            head = fh.read(FRAME_HEAD.size)
            if len(head) < FRAME_HEAD.size:
                break
            magic, length, _count, _crc, _hcrc = FRAME_HEAD.unpack(head)
            if magic != SHARD_MAGIC:
                return  # not a clean stream of frames: leave it to the reader to report
            if pos + FRAME_HEAD.size + length > size:
                break
            pos += FRAME_HEAD.size + length
        if pos < size:
            fh.truncate(pos)
