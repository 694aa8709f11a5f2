"""`pdtrace check --lenient` in a child process, for the viewer (issue 22).

The viewer runs the detectors over a list of parsed events when a trace is small. A big one
(hundreds of MB, millions of events) would take that many GB in the viewer's process, so
``Job`` runs the streamed check (``stream.run``: memory bounded by the detectors' live
state) in a spawned child instead: the viewer's UI keeps its own CPU and memory, and gets
the same findings and per-class coverage as `pdtrace check --lenient TRACE`. The child
reports how far it has read. No Textual, no vLLM.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from typing import Any

PROGRESS_EVERY = 0.5  # seconds between the child's progress messages


def check(path: str, progress: Any = None) -> tuple[list, dict]:
    """(findings, coverage by bug class) of the trace at ``path``, read leniently, as
    `pdtrace check --lenient` finds them (``checking.check_file``, in one process)."""
    from .checking import check_file

    checked = check_file(path, lenient=True, progress=progress)
    return checked.findings, checked.coverage


def prepare() -> None:
    """Start multiprocessing's resource tracker now, while ``sys.stderr`` is the process's
    own: a spawn starts it on first use and hands it ``sys.stderr.fileno()``, which under a
    running Textual app (stderr captured) is not a file descriptor."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _child(conn: Any, path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the viewer stops it (Job.cancel)
    null = os.open(os.devnull, os.O_WRONLY)  # (the viewer's terminal is not ours to write on)
    os.dup2(null, 1)
    os.dup2(null, 2)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            conn.send(("progress", done / max(total, 1)))

    try:
        findings, cov = check(path, progress)
        msg: tuple = ("done", findings, cov)
    except Exception as exc:  # (a PdtraceError names the file and line; anything else is a pdtrace bug)
        msg = ("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))
    conn.send(msg)
    conn.close()


class Job:
    """The check of ``path`` running in a spawned child (spawn, not fork: the viewer has
    threads). ``poll`` returns None while it runs, then ("done", findings, coverage) or
    ("failed", one line, traceback); ``fraction``: how much of the file it has read."""

    def __init__(self, path: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child, args=(send, path), daemon=True, name="pdtrace-check")
        self.proc.start()
        send.close()
        self.fraction = 0.0

    def poll(self, timeout: float = 0.2) -> tuple | None:
        try:
            while self._conn.poll(timeout):
                msg = self._conn.recv()
                if msg[0] != "progress":
                    self.proc.join()
                    return msg
                self.fraction = msg[1]
                timeout = 0
        except (EOFError, OSError):  # the child died (killed, out of memory)
            self.proc.join()
            return ("failed", f"the detectors' process ended with exit code {self.proc.exitcode}", "")
        return None

    def cancel(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self._conn.close()
