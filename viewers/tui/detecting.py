"""How the viewer runs the detectors (and the per-class coverage), in its index worker.

A trace up to ``detect_max_bytes`` is checked in this process over the index's events
parsed into a list (fast; the list goes when the findings are in). A bigger trace file is
checked by `pdtrace check --lenient`'s streamed detectors in a child process
(``pdtrace.detectors.background``), started with the indexing so the two share the
machine's cores; memory stays bounded however big the trace, and the findings list shows
how far the check has read. Where that child fails, D runs the in-process check anyway.
"""

from __future__ import annotations

from typing import Any

from .messages import DetectProgress, FindingsReady


class DetectMixin:
    """Mixed into ``PdtraceViewer`` (which owns ``index``, ``detect``, ``cover``,
    ``detect_max_bytes``, ``_force_detect``, ``_default_detect``)."""

    _job: Any = None

    def _streamed(self) -> bool:
        """The detectors run streamed in a child: pdtrace's own detectors, over a trace file
        (not shards merged in memory) above ``detect_max_bytes``, unless D forced them here."""
        idx = self.index  # type: ignore[attr-defined]
        return (self._default_detect and self.detect is not None  # type: ignore[attr-defined]
                and idx._memory is None and bool(idx.path) and idx.size > self.detect_max_bytes  # type: ignore[attr-defined]
                and not self._force_detect)  # type: ignore[attr-defined]

    def _prepare_job(self) -> None:
        """Before the app runs (``PdtraceViewer.__init__``), where a child process will be
        spawned (the streamed check, the index scan): see ``background.prepare``."""
        if self._streamed() or self.scan_child:  # type: ignore[attr-defined]
            from pdtrace.detectors.background import prepare

            try:
                prepare()
            except Exception:  # (then the Job fails, and says so)
                pass

    def _start_job(self) -> None:
        if self._job is None and self._streamed():
            from pdtrace.detectors.background import Job

            try:
                self._job = Job(self.index.path)  # type: ignore[attr-defined]
            except Exception as exc:  # (cannot start a process: the D key still works)
                self._job = ("failed", f"{type(exc).__name__}: {exc}")

    def _cancel_job(self) -> None:
        job, self._job = self._job, None
        if job is not None and not isinstance(job, tuple):
            job.cancel()

    def _run_detectors(self, worker: Any) -> None:
        post = self.post_message  # type: ignore[attr-defined]
        if self.detect is None:  # type: ignore[attr-defined]
            post(FindingsReady([], "detectors unavailable (pdtrace.detectors.run_all not importable)"))
            return
        if self._job is not None:
            self._await_job(worker)
            return
        idx = self.index  # type: ignore[attr-defined]
        if idx.size > self.detect_max_bytes and not self._force_detect:  # type: ignore[attr-defined]
            post(FindingsReady([], f"{idx.size >> 20} MiB trace: detectors not run automatically (they parse "
                                   "every event into memory); press D to run them, or use `pdtrace check`"))
            return
        cov = None
        try:
            # run_all takes a list (it indexes events by kind); the index itself keeps offsets only
            events = list(idx.iter_events())
            if worker.is_cancelled:
                return
            findings = list(self.detect(events, header=idx.header))  # type: ignore[attr-defined]
            if idx.gaps:  # damaged .zst frames skipped: what comes after rests on lost lines
                findings = _after_gaps(idx, findings)
            if self.cover is not None:  # type: ignore[attr-defined]
                try:
                    from pdtrace.detectors.coverage import incomplete_reason

                    cov = self.cover(events, header=idx.header, footer=idx.footer,  # type: ignore[attr-defined]
                                     incomplete=incomplete_reason(idx.footer, idx.problems))
                except Exception:  # coverage is a summary; the findings stand without it
                    cov = None
            notes = _crossing(events)
            del events
        except Exception as exc:  # a detector bug must not take the viewer down
            post(FindingsReady([], f"detectors failed: {type(exc).__name__}: {exc}"))
            return
        if not worker.is_cancelled:
            post(FindingsReady(findings, coverage=cov, notes=notes))

    def _await_job(self, worker: Any) -> None:
        post = self.post_message  # type: ignore[attr-defined]
        job = self._job
        msg = job if isinstance(job, tuple) else None
        shown = -1
        while msg is None:
            if worker.is_cancelled:
                self._cancel_job()
                return
            msg = job.poll(0.2)
            pct = int(100 * job.fraction)
            if msg is None and pct != shown:
                shown = pct
                post(DetectProgress(job.fraction))
        self._job = None
        if msg[0] == "done":
            post(FindingsReady(list(msg[1]), coverage=msg[2]))
        else:
            post(FindingsReady([], f"detectors failed in their process: {msg[1]}; press D to run them here "
                                   "(they parse every event into memory), or use `pdtrace check --lenient`"))


def _after_gaps(idx: Any, findings: list) -> list:
    """The viewer reads on past damaged frames (``TraceIndex.gaps``); the findings citing an event
    after the first gap are made inconclusive (``ringcut.mark_after_gap``)."""
    from bisect import bisect_left

    from pdtrace.detectors.ringcut import mark_after_gap

    gap = idx.gaps[0]
    first = bisect_left(idx.starts, gap["at"])  # the first event indexed after the gap
    where = f"the {gap['lost']} bytes lost at line {gap['line']} (damaged zstd frames)"
    return mark_after_gap(findings, lambda eid: idx.ordinal(eid) >= first, where)


def _crossing(events: list) -> dict[str, list] | None:
    """Where D's prompt tokens came from, per instance pair (``detectors.crossed``): shown under the
    kv-never-crossed class in the findings list. A summary: the findings stand without it."""
    try:
        from pdtrace.detectors.base import KV_NEVER_CROSSED
        from pdtrace.detectors.crossed import pair_notes

        return {KV_NEVER_CROSSED: pair_notes(events)}
    except Exception:  # noqa: BLE001
        return None
