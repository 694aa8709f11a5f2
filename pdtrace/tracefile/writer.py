"""Writing a whole trace (merge, scenarios, samples): header, events, footer.

The per-process hot path is ``pdtrace.record.recorder`` (shards); ``pdtrace.record.shards`` merges the
shards through ``write_trace``. Both functions are also importable from ``pdtrace.tracefile.trace``.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Iterable

import orjson

from .. import schema
from .compress import open_write, wants_zstd
from .footer import FooterCounter
from .typecheck import Signer


def make_header(*, origin: str, cmd: list[str] | None = None, redacted: bool = True,
                versions: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    import datetime
    import socket

    from .. import __version__
    from .versions import collect_versions

    h = {
        "ev": schema.HEADER,
        "schema": schema.SCHEMA_NAME,
        "schema_version": schema.SCHEMA_VERSION,
        "pdtrace": __version__,
        "versions": versions if versions is not None else collect_versions(),
        "cmd": list(cmd or []),
        "host": socket.gethostname(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "redacted": redacted,
        "origin": origin,
    }
    h.update(extra)
    return h


def write_trace(path: str, header: dict[str, Any], events: Iterable[dict[str, Any]],
                footer: dict[str, Any] | Callable[[FooterCounter], dict[str, Any]] | None = None, *,
                assign_ids: bool = True) -> dict[str, Any]:
    """Write a complete trace: header, events (ids assigned in order), footer. ``events`` may
    be any iterable (a streaming merge): with ``footer`` None or a callable, the footer is
    counted while the events are written (the callable gets the counter and returns the
    footer to write), so nothing needs to hold the events. Each event is type-checked on its
    way out (``pdtrace.tracefile.typecheck``); when all pass, the footer gets the ``digest`` of the event
    lines, which lets a reader skip its own type checks. A ``path`` ending in ``.zst`` is
    written zstd-compressed (``pdtrace.tracefile.compress``). Returns the footer written."""
    counter = FooterCounter() if footer is None or callable(footer) else None
    signer = Signer()
    sign = signer.add
    dumps = orjson.dumps
    tmp = path + ".tmp"
    try:
        with open_write(tmp, compressed=wants_zstd(path)) as fh:
            buf = io.BufferedWriter(fh, 1 << 20)  # type: ignore[arg-type]
            buf.write(dumps(header) + b"\n")
            for i, e in enumerate(events):
                if assign_ids:
                    e["id"] = i
                if counter is not None:
                    counter.add(e)
                if "block_ids_derived" in e:  # loader-derived (schema v2): keep the file compact
                    e = {k: v for k, v in e.items() if k != "block_ids" and k != "block_ids_derived"}
                line = dumps(e) + b"\n"
                sign(e, line)
                buf.write(line)
            if counter is not None:
                footer = footer(counter) if callable(footer) else counter.footer()
            footer = {k: v for k, v in footer.items() if k != "digest"}  # type: ignore[union-attr]
            digest = signer.digest()
            if digest is not None:  # every event passed the type check: readers may skip theirs
                footer["digest"] = digest
            buf.write(dumps(footer) + b"\n")
            buf.flush()
        os.replace(tmp, path)
    except BaseException:  # disk full, interrupted: no half-written .tmp left behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return footer  # type: ignore[return-value]
