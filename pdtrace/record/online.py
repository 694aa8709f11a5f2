"""Online checks of the flight recorder (``pdtrace record --ring``): the two bug classes
whose evidence sits in one worker's own events are checked as the writer thread flushes
them, and the first hit asks ``pdtrace record`` for a snapshot trace, so a one-in-thousands
race is kept on disk when it happens instead of rotating out of the window.

Rules (each fires once per process; the offline detectors decide, this only triggers):

- ``stale-accepted-count-read``: an ``acc.read`` whose copy's CUDA event had not completed
  (``event_done`` False) and that did not synchronize (``synced`` not True): the racy read
  of vLLM thread 004;
- ``connector-metadata-cleared-before-drafter``: on a KV-saving instance (P, PD), a
  ``kvmeta.clear`` after the step's ``kvmeta.bind`` and before its drafter
  ``spec.phase`` begins (vLLM thread 002).

They read the queued event tuples on the writer thread, after the batch is written, so
``emit()`` on the traced thread costs the same as without them. A hit writes
``online-check.<pid>.trigger`` (JSON: rule, reason, pid, inst, step, monotonic and wall
time) into the session directory and sends SIGUSR1 to ``pdtrace record``
(``PDTRACE_RECORD_PID``); the snapshot's header says ``snapshot: "online check: ..."``.
``PDTRACE_ONLINE_CHECK=0`` turns them off.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Iterable

TRIGGER_SUFFIX = ".trigger"
STALE = "stale-accepted-count-read"
METADATA = "connector-metadata-cleared-before-drafter"
_SAVING = ("P", "PD")


class OnlineCheck:
    """The rules over one process's queued events (``(kind, t, req, step, fields)``)."""

    def __init__(self, inst: str | None = None):
        self.inst = inst
        self.fired: set[str] = set()
        self._cleared: Any = None  # the step whose metadata was cleared before its drafter began
        self._drafter = False

    def scan(self, items: Iterable[tuple], inst: str | None = None) -> tuple[str, str, Any] | None:
        """The first rule that fires in ``items`` as (rule, reason, step), or None."""
        if inst is not None:
            self.inst = inst
        hit = None
        for kind, _t, req, step, fields in items:
            if kind == "acc.read":
                if (STALE not in self.fired and hit is None and fields.get("event_done") is False
                        and fields.get("synced") is not True):
                    hit = (STALE, f"racy accepted-count read: {req} step {step} row {fields.get('row')} read the "
                           f"CPU copy before its CUDA event {fields.get('event')!r} completed, without a sync", step)
            elif kind == "kvmeta.bind":
                self._cleared, self._drafter = None, False
            elif kind == "kvmeta.clear":
                if not self._drafter and self._cleared is None:
                    self._cleared = step if step is not None else -1
            elif kind == "spec.phase" and fields.get("phase") == "drafter" and fields.get("edge") == "begin":
                self._drafter = True
                if (self._cleared is not None and METADATA not in self.fired and hit is None
                        and self.inst in _SAVING):
                    hit = (METADATA, f"connector metadata cleared before the drafter ran on {self.inst} "
                           f"(step {step}): the drafter's KV is not saved", step)
        if hit is not None:
            self.fired.add(hit[0])
        return hit


def trigger(directory: str | None, pid: int, inst: str | None, hit: tuple[str, str, Any],
            wall_off: int = 0) -> bool:
    """Write the trigger file and signal ``pdtrace record``; False when there is no record
    process to ask (no ``PDTRACE_RECORD_PID``) or it is gone."""
    rule, reason, step = hit
    target = os.environ.get("PDTRACE_RECORD_PID")
    if not directory or not target:
        return False
    t = time.monotonic_ns()
    doc = {"rule": rule, "reason": reason, "pid": pid, "inst": inst, "step": step, "t": t, "w": t + wall_off}
    path = os.path.join(directory, f"online-check.{pid}.{rule}{TRIGGER_SUFFIX}")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)
    try:
        os.kill(int(target), signal.SIGUSR1)
    except (OSError, ValueError):
        return False
    return True


def take_triggers(directory: str) -> list[dict[str, Any]]:
    """The trigger files written since the last call (``pdtrace record``, on SIGUSR1), each
    renamed to ``.seen`` so that the next snapshot does not claim it again."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.endswith(TRIGGER_SUFFIX):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as fh:
                out.append(json.load(fh))
            os.replace(path, path[: -len(TRIGGER_SUFFIX)] + ".seen")
        except (OSError, ValueError):
            continue
    return out


def enabled() -> bool:
    return os.environ.get("PDTRACE_ONLINE_CHECK", "1") != "0"
