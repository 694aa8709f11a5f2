"""``TraceIndex.scan(child=True)``: the index of a big trace built in a spawned child process
(issue 39), so that the viewer's own process keeps its interpreter for the UI.

Indexing is per-line Python (parse, check, a few column appends): in the viewer's process it
shares one GIL with the UI's redraws and the panes' queries, and a 10M-event trace took
half as long again as it does alone. The child runs the very same ``TraceIndex.scan`` over
the file and, after each batch, sends what the batch added; the parent appends it to its own
``TraceIndex`` with C-level copies (``array.frombytes``, dict updates) and yields the same
``ScanProgress`` as the in-process scan. The parent's index is then exactly the one an
in-process scan builds (``tests/test_index_child.py`` compares them field by field on every
sample, damaged ones and seekable .zst included), and it reads events from the file itself
(``event``), as before.

What a batch carries: the new rows of the six columns (as bytes), the new request and
instance names, per request touched the ordinals it gained, ``req_insts`` whole, the
``step_ranges`` entries touched, the ``first_of_kind`` / ``remote_req`` / id entries seen
(set-if-absent in the parent, as ``_add`` does), the new problems and gaps, the header (first
batch) and footer. The child keeps none of the columns it has sent: its memory is one batch.

A ``TraceError`` in the child (a strict scan's first problem, a file that is not a trace)
is raised again in the parent with the same file, line and reason; a child that dies (killed,
out of memory) ends the scan with a ``TraceError`` that says so, never a shorter index that
looks whole. Where no process can be started, the scan runs in this process instead.
No Textual, no vLLM.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from array import array
from typing import Any, Iterator

from ..errors import TraceError
from .columns import NO_REQ, NO_STEP

COLUMNS = (("starts", "q"), ("lengths", "I"), ("kinds", "B"), ("steps", "i"), ("reqs", "i"), ("insts", "B"))


def _batch(idx: Any, sent: dict[str, int], pos: int, done: bool) -> dict[str, Any]:
    """What ``idx`` (the child's index) added since the last batch; resets what it sent."""
    out: dict[str, Any] = {"pos": pos, "done": done}
    for name, _code in COLUMNS:
        out[name] = getattr(idx, name).tobytes()
    out["req_names"] = idx.req_names[sent["reqs"]:]
    out["inst_names"] = idx.inst_names[sent["insts"]:]
    sent["reqs"], sent["insts"] = len(idx.req_names), len(idx.inst_names)
    touched = set(idx.reqs)
    touched.discard(NO_REQ)
    out["req_events"] = {rc: idx.req_events[rc].tobytes() for rc in touched}
    out["req_insts"] = idx.req_insts.tobytes()
    out["step_ranges"] = {key: tuple(idx.step_ranges[key])
                          for key in set(zip(idx.insts, idx.steps)) if key[1] != NO_STEP}
    out["first_of_kind"], idx.first_of_kind = idx.first_of_kind, {}
    out["remote_req"], idx.remote_req = idx.remote_req, {}
    out["id_to_ord"], idx.id_to_ord = idx.id_to_ord, {}
    out["ord_to_id"], idx.ord_to_id = idx.ord_to_id, {}
    out["problems"] = idx.problems[sent["problems"]:]
    out["gaps"] = idx.gaps[sent["gaps"]:]
    sent["problems"], sent["gaps"] = len(idx.problems), len(idx.gaps)
    if sent["header"] == 0 and idx.header:
        out["header"], out["newer"], sent["header"] = idx.header, idx._newer, 1
    if sent["footer"] == 0 and idx.footer is not None:
        out["footer"], sent["footer"] = idx.footer, 1
    out["stream_damaged"] = idx.stream_damaged
    idx._base += len(idx.kinds)  # the rows sent: ``_add`` numbers the next ones after them
    for name, code in COLUMNS:
        setattr(idx, name, array(code))
    for rc in touched:
        idx.req_events[rc] = array("i")
    return out


def _child(conn: Any, cls: Any, path: str, lenient: bool, batch_time: float) -> None:
    """``cls``: ``TraceIndex`` (handed over by the parent: pickled by name, imported here)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (closing the scan)
    null = os.open(os.devnull, os.O_WRONLY)  # (the viewer's terminal is not ours to write on)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sent = dict.fromkeys(("reqs", "insts", "problems", "gaps", "header", "footer"), 0)
    try:
        idx = cls(path, lenient=lenient)
        for prog in idx._scan(batch_time):
            conn.send(("batch", _batch(idx, sent, prog.scanned, prog.done)))
    except TraceError as exc:
        conn.send(("error", exc.line, exc.reason, exc.damaged))
    except Exception as exc:  # a pdtrace bug: said, with where it happened
        conn.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6)))
    conn.close()


def _apply(idx: Any, b: dict[str, Any]) -> None:
    """Append batch ``b`` to the parent's index ``idx``: names first, then each request's
    ordinals, the dictionaries, and the columns last (a pane reading meanwhile sees a row only
    once everything about it is in)."""
    if "header" in b:
        idx.header = b["header"]
        idx._newer = bool(b.get("newer"))
    for name in b["req_names"]:
        idx.req_code[name] = len(idx.req_names)
        idx.req_names.append(name)
        idx.req_events[idx.req_code[name]] = array("i")
    for name in b["inst_names"]:
        idx.inst_code[name] = len(idx.inst_names)
        idx.inst_names.append(name)
    for rc, ords in b["req_events"].items():
        idx.req_events[rc].frombytes(ords)
    idx.req_insts = array("B", b["req_insts"])
    for key, (first, last) in b["step_ranges"].items():
        idx.step_ranges[key] = [first, last]
    for d in ("first_of_kind", "remote_req"):
        mine = getattr(idx, d)
        for k, v in b[d].items():
            mine.setdefault(k, v)
    idx.id_to_ord.update(b["id_to_ord"])
    idx.ord_to_id.update(b["ord_to_id"])
    idx.problems.extend(b["problems"])
    idx.gaps.extend(b["gaps"])
    if "footer" in b:
        idx.footer = b["footer"]
    idx.stream_damaged = b["stream_damaged"]
    for name, _code in COLUMNS:
        getattr(idx, name).frombytes(b[name])


def start(idx: Any, batch_time: float) -> Iterator[Any] | None:
    """The child's scan of ``idx.path`` as a generator of ``ScanProgress`` (see the module
    doc), or None where no process can be started (the caller scans in-process)."""
    try:
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, type(idx), idx.path, idx.lenient, batch_time), daemon=True,
                           name="pdtrace-index")
        proc.start()
    except (OSError, RuntimeError, ValueError):
        return None
    send.close()
    return _receive(idx, proc, recv)


def _receive(idx: Any, proc: Any, recv: Any) -> Iterator[Any]:
    path = idx.path or ""
    try:
        while True:
            try:
                msg = recv.recv()
            except (EOFError, OSError):
                proc.join()
                raise TraceError(path, 0, f"the indexing process ended (exit code {proc.exitcode}) before the "
                                          f"end of the trace; {len(idx)} events were indexed") from None
            if msg[0] == "error":
                raise TraceError(path, msg[1], msg[2], damaged=msg[3])
            if msg[0] == "failed":
                raise RuntimeError(f"pdtrace's indexing process failed: {msg[1]}\n{msg[2]}")
            b = msg[1]
            _apply(idx, b)
            if b["done"]:
                idx.done = True
                yield idx._progress(idx.size, done=True)
                return
            yield idx._progress(b["pos"])
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
