"""Per-process start of recording, driven by environment variables set by `pdtrace record`.

PDTRACE_SESSION_DIR  shard directory (one <pid>.pdshard per process)
PDTRACE_SESSION      session id
PDTRACE_REDACT       "1" (default) or "0"
PDTRACE_FLUSH        writer flush interval, seconds
PDTRACE_INSTANCE     force the instance id (P, D, ...)
PDTRACE_HOOKS        "0" to record process events only (no vLLM hooks)
PDTRACE_RING        flight recorder: keep about the last N seconds per process (pdtrace.record.ring)
"""

from __future__ import annotations

import os
import signal

from pdtrace.record import recorder as _recorder

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(__file__))


def start_from_env() -> None:
    if _recorder.get() is not None and _recorder.get().pid == os.getpid():
        return
    directory = os.environ["PDTRACE_SESSION_DIR"]
    rec = _recorder.start_process_recording(
        directory,
        session=os.environ.get("PDTRACE_SESSION", ""),
        redact=os.environ.get("PDTRACE_REDACT", "1") != "0",
        flush_interval=float(os.environ.get("PDTRACE_FLUSH", "0.2")),
        ring_s=float(os.environ["PDTRACE_RING"]) if os.environ.get("PDTRACE_RING") else None,
    )
    _flush_on_sigterm(rec)
    if os.environ.get("PDTRACE_HOOKS", "1") != "0":
        from pdtrace import hooks

        hooks.install_all()


def _flush_on_sigterm(rec: "_recorder.Recorder") -> None:
    """If SIGTERM would kill this process outright (default disposition), write the trace
    first and then die by the same signal, so the traced program's behaviour is unchanged.
    Programs that install their own SIGTERM handler (vLLM does) keep it and exit through
    atexit, which closes the recorder."""
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def _on_term(signum, frame):  # noqa: ARG001
            try:
                cur = _recorder.get()
                if cur is not None:
                    cur.close()
            finally:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, _on_term)
    except ValueError:  # not the main thread
        pass
