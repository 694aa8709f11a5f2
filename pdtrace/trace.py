"""Trace loader: the only code that reads trace files.

``load(path)`` reads a whole trace into a ``Trace`` (header, events, footer, problems);
``iter_events(path)`` streams events without keeping them. Events are plain dicts with
the field names of ``pdtrace.schema`` (fast to parse, nothing to convert).

Errors name the line: a truncated last line, a corrupt line, a foreign file, an unknown
event kind, or a header with a newer ``schema_version`` raise ``TraceError(path, line,
reason)`` unless ``lenient=True``, in which case every valid event is kept and each bad
line becomes a ``Problem`` in ``trace.problems``.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable, Iterable, Iterator

import orjson

from . import schema
from .errors import TraceError

_KIND_REQUIRED = {name: schema.REQUIRED_COMMON | k.required for name, k in schema.KINDS.items()}


@dataclasses.dataclass
class Problem:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclasses.dataclass
class Trace:
    path: str
    header: dict[str, Any]
    events: list[dict[str, Any]]
    footer: dict[str, Any] | None
    problems: list[Problem]

    @property
    def complete(self) -> bool:
        return self.footer is not None and not self.problems

    def versions(self) -> dict[str, str]:
        return dict(self.header.get("versions") or {})


ProgressFn = Callable[[int, int], None]  # (bytes read, total bytes)


def _check_header(path: str, obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or obj.get("ev") != schema.HEADER or obj.get("schema") != schema.SCHEMA_NAME:
        raise TraceError(path, 1, "not a pdtrace trace: line 1 is not a pdtrace 'trace.header' line")
    ver = obj.get("schema_version")
    if not isinstance(ver, int):
        raise TraceError(path, 1, "header has no integer schema_version")
    return obj


def _open(path: str) -> tuple[Any, int]:
    """Open a trace for reading: (binary file, size in bytes)."""
    try:
        return open(path, "rb"), os.path.getsize(path)
    except OSError as exc:
        raise TraceError(path, 0, f"cannot open: {exc.strerror or exc}") from None


def _read_header(path: str, fh: Any) -> tuple[dict[str, Any], bytes]:
    """Read and check line 1 of an open trace: (header, the raw line)."""
    first = fh.readline()
    if not first:
        raise TraceError(path, 0, "empty file: not a pdtrace trace")
    try:
        return _check_header(path, orjson.loads(first)), first
    except orjson.JSONDecodeError:
        raise TraceError(path, 1, "not a pdtrace trace: line 1 is not JSON") from None


def scan(
    path: str,
    *,
    lenient: bool = False,
    progress: ProgressFn | None = None,
    validate: bool = True,
) -> Iterator[tuple[str, int, Any]]:
    """Yield ("header"|"event"|"footer"|"problem", line_no, payload) for each line.

    Raises TraceError at the first problem unless ``lenient``.
    """
    fh, total = _open(path)
    loads = orjson.loads
    required = _KIND_REQUIRED
    newer = False
    with fh:
        header, first = _read_header(path, fh)
        if header["schema_version"] > schema.SCHEMA_VERSION:
            reason = (f"trace schema_version {header['schema_version']} is newer than this pdtrace reads "
                      f"({schema.SCHEMA_VERSION}); upgrade pdtrace, or use --lenient to read known event kinds")
            if not lenient:
                raise TraceError(path, 1, reason)
            newer = True
            yield "problem", 1, reason
        yield "header", 1, header
        line_no = 1
        pos = len(first)
        next_progress = 0
        footer_seen = False
        for raw in fh:
            line_no += 1
            pos += len(raw)
            if progress is not None and pos >= next_progress:
                progress(pos, total)
                next_progress = pos + (1 << 24)
            problem = None
            try:
                obj = loads(raw)
            except orjson.JSONDecodeError:
                if not raw.endswith(b"\n"):
                    problem = "truncated line (no newline at end of file: the writer stopped mid-line)"
                elif not raw.strip():
                    problem = "blank line"
                else:
                    problem = "corrupt line: not valid JSON"
                obj = None
            if problem is None:
                kind = obj.get("ev") if isinstance(obj, dict) else None
                if kind is None:
                    problem = "corrupt line: not a JSON object with an 'ev' field"
                elif footer_seen:
                    problem = "data after the footer"
                elif kind == schema.FOOTER:
                    footer_seen = True
                    yield "footer", line_no, obj
                    continue
                elif validate:
                    req = required.get(kind)
                    if req is None:
                        problem = schema.new_kind_error(kind)
                        if newer:  # expected: a newer writer has kinds we do not know
                            continue
                    elif not obj.keys() >= req:
                        problem = f"{kind}: missing field(s) {', '.join(sorted(req - obj.keys()))}"
            if problem is not None:
                if not lenient:
                    raise TraceError(path, line_no, problem)
                yield "problem", line_no, problem
                continue
            yield "event", line_no, obj
        if progress is not None:
            progress(total, total)
        if not footer_seen:
            reason = "no footer: the trace ends early (recording killed, or file cut)"
            if not lenient:
                raise TraceError(path, line_no + 1, reason)
            yield "problem", line_no + 1, reason


def _load_fast(path: str, progress: ProgressFn | None) -> Trace | None:
    """The common case, a clean trace, in one tight loop (no per-line generator / tuples).

    Returns None at the first line that needs a verdict (bad JSON, unknown kind, missing
    fields, data after the footer, no footer, newer schema): ``load`` then re-reads the
    file through ``scan``, which produces the exact errors / problems. Opening and header
    errors are raised here exactly as ``scan`` raises them.
    """
    fh, total = _open(path)
    loads = orjson.loads
    required = _KIND_REQUIRED
    footer_kind = schema.FOOTER
    events: list[dict[str, Any]] = []
    append = events.append
    footer = None
    with fh:
        header, first = _read_header(path, fh)
        if header["schema_version"] > schema.SCHEMA_VERSION:
            return None
        pos = len(first)
        next_progress = 0 if progress is not None else 1 << 62
        n = 0
        for raw in fh:
            if footer is not None:
                return None  # data after the footer
            pos += len(raw)
            if pos >= next_progress:
                progress(pos, total)  # type: ignore[misc]
                next_progress = pos + (1 << 24)
            try:
                obj = loads(raw)
                req = required.get(obj["ev"])
            except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
                return None
            if req is None:
                if obj["ev"] == footer_kind:
                    footer = obj
                    continue
                return None
            if not obj.keys() >= req:
                return None
            if "id" not in obj:
                obj["id"] = n
            n += 1
            append(obj)
        if progress is not None:
            progress(total, total)
    if footer is None:
        return None
    return Trace(path, header, events, footer, [])


def derive_block_lists(events: Iterable[dict[str, Any]]) -> int:
    """Fill in ``block_ids`` of ``sched.alloc`` events that only carry ``new_block_ids``
    (schema v2: a running request's call that appended blocks). The full list is the
    previous sched.alloc's of the same (pid, inst, req) plus the new ids, per group; the
    event gets ``block_ids_derived: true``. An event with no earlier list (a trace cut at
    its start) is left without ``block_ids``. Events must be in trace order. Returns how
    many were derived."""
    held: dict[tuple, list] = {}
    n = 0
    for e in events:
        if e.get("ev") != "sched.alloc":
            continue
        key = (e.get("pid"), e.get("inst"), e.get("req"))
        full = e.get("block_ids")
        if full is None or e.get("block_ids_derived"):
            prev = held.get(key)
            new = e.get("new_block_ids") or []
            if prev is None:
                continue
            full = [list(prev[g]) + list(new[g] if g < len(new) else ())
                    for g in range(max(len(prev), len(new)))]
            e["block_ids"] = full
            e["block_ids_derived"] = True
            n += 1
        if e.get("ok", True):
            held[key] = full
    return n


def load(path: str, *, lenient: bool = False, progress: ProgressFn | None = None) -> Trace:
    tr = _load(path, lenient=lenient, progress=progress)
    if tr.header.get("schema_version", 1) >= 2:
        derive_block_lists(tr.events)
    return tr


def _load(path: str, *, lenient: bool = False, progress: ProgressFn | None = None) -> Trace:
    import gc

    # Parsing creates millions of small dicts; the cyclic GC would rescan them over and over
    # while they can hold no cycles. Pause it for the load (restored even on errors).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tr = _load_fast(path, progress)
        if tr is not None:
            return tr
        return _load_scan(path, lenient=lenient, progress=progress)
    finally:
        if was_enabled:
            gc.enable()


def _load_scan(path: str, *, lenient: bool = False, progress: ProgressFn | None = None) -> Trace:
    header: dict[str, Any] = {}
    footer = None
    events: list[dict[str, Any]] = []
    problems: list[Problem] = []
    append = events.append
    for what, line, obj in scan(path, lenient=lenient, progress=progress):
        if what == "event":
            if "id" not in obj:
                obj["id"] = len(events)
            append(obj)
        elif what == "header":
            header = obj
        elif what == "footer":
            footer = obj
        else:
            problems.append(Problem(line, obj))
    return Trace(path, header, events, footer, problems)


def iter_events(path: str, *, lenient: bool = False) -> Iterator[dict[str, Any]]:
    n = 0
    for what, _line, obj in scan(path, lenient=lenient):
        if what == "event":
            if "id" not in obj:
                obj["id"] = n
            n += 1
            yield obj


# --------------------------------------------------------------------------------------
# writing a whole trace (merge, scenarios); the per-process hot path is pdtrace.recorder
# --------------------------------------------------------------------------------------

def make_header(*, origin: str, cmd: list[str] | None = None, redacted: bool = True,
                versions: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    import datetime
    import socket

    from . import __version__
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


def make_footer(events: Iterable[dict[str, Any]], *, exit_code: int | None = None,
                extra_processes: dict[int, dict] | None = None) -> dict[str, Any]:
    """Summarize events (counts, drops, hook errors, hooks, processes) into a footer."""
    counts: dict[str, int] = {}
    dropped = 0
    hook_errors: dict[str, int] = {}
    applied: set[str] = set()
    skipped: dict[str, str] = {}
    procs: dict[int, dict] = {}
    n = 0
    for e in events:
        n += 1
        k = e["ev"]
        counts[k] = counts.get(k, 0) + 1
        p = procs.setdefault(e["pid"], {"pid": e["pid"], "role": e["role"], "inst": e["inst"],
                                        "events": 0, "dropped": 0, "complete": False})
        p["events"] += 1
        p["role"], p["inst"] = e["role"], e["inst"]
        if k == "proc.exit":
            p["complete"] = True
            p["dropped"] = e.get("dropped", 0)
            dropped += e.get("dropped", 0)
            for h, c in (e.get("hook_errors") or {}).items():
                hook_errors[h] = hook_errors.get(h, 0) + c
        elif k == "hooks.status":
            applied.update(e.get("applied") or ())
            for h, why in (e.get("skipped") or {}).items():
                skipped.setdefault(h, why)
    for h in applied:
        skipped.pop(h, None)
    footer: dict[str, Any] = {
        "ev": schema.FOOTER,
        "events": n,
        "counts": counts,
        "dropped": dropped,
        "hook_errors": hook_errors,
        "hooks": {"applied": sorted(applied), "skipped": skipped},
        "processes": sorted(procs.values(), key=lambda p: p["pid"]),
    }
    if exit_code is not None:
        footer["exit_code"] = exit_code
    return footer


def write_trace(path: str, header: dict[str, Any], events: list[dict[str, Any]],
                footer: dict[str, Any] | None = None, *, assign_ids: bool = True) -> dict[str, Any]:
    """Write a complete trace: header, events (ids assigned in order), footer."""
    if footer is None:
        footer = make_footer(events, exit_code=None)
    dumps = orjson.dumps
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        buf = io.BufferedWriter(fh, 1 << 20)  # type: ignore[arg-type]
        buf.write(dumps(header) + b"\n")
        for i, e in enumerate(events):
            if assign_ids:
                e["id"] = i
            if "block_ids_derived" in e:  # loader-derived (schema v2): keep the file compact
                e = {k: v for k, v in e.items() if k != "block_ids" and k != "block_ids_derived"}
            buf.write(dumps(e) + b"\n")
        buf.write(dumps(footer) + b"\n")
        buf.flush()
    os.replace(tmp, path)
    return footer
