"""The recorder: the only code that writes trace events.

One ``Recorder`` per process. Hooks call ``emit(kind, **fields)`` on the caller's thread;
that call only reads the clock, builds a tuple and appends it to a bounded deque (no I/O,
no locks, no CUDA calls). A daemon writer thread wakes every ``flush_interval`` seconds,
serializes the batch with orjson and appends it to this process's shard file, so a
SIGKILLed process loses at most its last interval. When the queue is full new events are
dropped and counted (the footer reports them); memory stays bounded.

Sinks:
- ``Recorder.to_shard_dir(dir)``: one ``<pid>.jsonl`` shard per process (used by
  ``pdtrace record``; shards are merged into one trace at the end).
- ``Recorder.in_memory()``: events kept in a list (tests, scenario builder), written out
  with ``write_trace``.
"""

from __future__ import annotations

import atexit
import collections
import functools
import marshal
import os
import sys
import threading
import time
import zlib
from typing import Any, Callable, Iterable

import orjson

from .. import schema
from .frames import FRAME_HEAD, SHARD_MAGIC, SHARD_SUFFIX, frame_head, write_frame  # noqa: F401
from .materialize import (
    DEFERRED_KEYS,
    GROW,
    PROMPT,
    Deferred,
    _json_default,
    _resolve_deferred,
    materialize,
    unpack_step,
)

_current: "Recorder | None" = None
_mono = time.monotonic_ns


def get() -> "Recorder | None":
    """The process's active recorder, or None when not recording."""
    return _current


def set_current(rec: "Recorder | None") -> "Recorder | None":
    global _current
    prev, _current = _current, rec
    return prev


class Recorder:
    def __init__(
        self,
        sink: Callable[[list[dict]], None] | None,
        *,
        role: str = schema.ROLE_MAIN,
        inst: str = schema.INST_NONE,
        rank: int | None = None,
        redact: bool = True,
        max_queue: int = 1_000_000,
        flush_interval: float = 0.2,
        threaded: bool = True,
    ):
        self.pid = os.getpid()
        self.role = role
        self.inst = os.environ.get("PDTRACE_INSTANCE") or inst
        self._inst_forced = bool(os.environ.get("PDTRACE_INSTANCE"))
        self.rank = rank
        self.redact = redact
        self.max_queue = max_queue
        self.flush_interval = flush_interval
        self._sink = sink
        self._q: collections.deque = collections.deque()
        self.dropped = 0
        self.emitted = 0
        self.hook_errors: dict[str, int] = {}
        self.step: int | None = None  # current engine step, set by the scheduler hook
        self.phase: str = ""  # current model phase, set by runner hooks
        self._mono0 = time.monotonic_ns()
        self._wall_off = time.time_ns() - self._mono0
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._failing = False
        self._online: Any = None  # flight recorder's online checks (to_shard_dir with ring_s)
        self._online_dir: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.events: list[dict] | None = None  # in-memory sink storage
        self._encode: Callable[[list[tuple]], Any] = self._materialize
        if threaded and sink is not None:
            self._start_thread()

    # -- construction helpers ---------------------------------------------------------
    @classmethod
    def in_memory(cls, **kw: Any) -> "Recorder":
        rec = cls(None, threaded=False, **kw)
        events: list[dict] = []
        rec.events = events

        def sink(batch: list[dict]) -> None:
            events.extend(_resolve_deferred(e) for e in batch)

        rec._sink = sink
        return rec

    @classmethod
    def to_shard_dir(cls, directory: str, ring_s: float | None = None, **kw: Any) -> "Recorder":
        """One shard file ``<pid>.pdshard`` in ``directory`` (see ``SHARD_MAGIC``); with
        ``ring_s``, rotating segment files that keep about the last ``ring_s`` seconds
        (``pdtrace.record.ring``)."""
        os.makedirs(directory, exist_ok=True)
        rec = cls(None, **{**kw, "threaded": False})
        rec.ring_s = ring_s
        if ring_s:
            from .ring import SegmentRing

            rec._ring = SegmentRing(directory, os.getpid(), ring_s)
            rec._sink = rec._write_ring
            rec._encode = rec._encode_ring
            from . import online

            if online.enabled():  # checked on the writer thread, after each write (pdtrace.record.online)
                rec._online = online.OnlineCheck()
                rec._online_dir = directory
        else:
            path = os.path.join(directory, f"{os.getpid()}{SHARD_SUFFIX}")
            rec._fh = open(path, "ab", buffering=0)  # type: ignore[attr-defined]
            rec.shard_path = path  # type: ignore[attr-defined]
            rec._sink = rec._write_frame
            rec._encode = rec._encode_frame  # the sink takes framed shard bytes, not dicts
        if kw.get("threaded", True):
            rec._start_thread()
        return rec

    def _write_frame(self, frame: bytes) -> None:
        write_frame(self._fh, frame)  # type: ignore[attr-defined]

    def _encode_ring(self, items: list[tuple]) -> tuple[bytes | None, bytes | None]:
        """Ring mode: the batch's pinned events (``ring.PINNED_KINDS``) and the others, each as
        a frame (None when there are none)."""
        from .ring import PINNED_KINDS

        pinned = [it for it in items if it[0] in PINNED_KINDS]
        if not pinned:
            return None, self._encode_frame(items)
        rest = [it for it in items if it[0] not in PINNED_KINDS]
        return self._encode_frame(pinned), (self._encode_frame(rest) if rest else None)

    def _write_ring(self, frames: tuple[bytes | None, bytes | None]) -> None:
        pinned, rest = frames
        if pinned is not None:
            self._ring.write(pinned, pinned=True)  # type: ignore[attr-defined]
        if rest is not None:
            self._ring.write(rest)  # type: ignore[attr-defined]

    # -- hot path ---------------------------------------------------------------------
    def emit(self, kind: str, req: str | None = None, step: int | None = None, **fields: Any) -> None:
        """Record one event. Cheap, non-blocking, never raises into the caller."""
        q = self._q
        if len(q) >= self.max_queue:
            self.dropped += 1
            return
        q.append((kind, _mono(), req, self.step if step is None else step, fields))

    def put(self, kind: str, req: str | None, step: int | None, fields: dict[str, Any]) -> None:
        """Hot-path form of ``emit`` for hooks that fire per step: positional, and ``fields``
        is a dict the caller built (no keyword-argument copying). ``step=None`` means the
        recorder's current step. The dict is owned by the recorder afterwards."""
        q = self._q
        if len(q) >= self.max_queue:
            self.dropped += 1
            return
        q.append((kind, _mono(), req, self.step if step is None else step, fields))

    def put_deferred(self, kind: str, req: str | None, step: int | None, fields: dict[str, Any],
                     keys: tuple[str, ...]) -> None:
        """``put`` for an event whose fields ``keys`` hold Deferred values (resolved by the writer)."""
        fields[DEFERRED_KEYS] = keys
        self.put(kind, req, step, fields)

    def hook_error(self, hook: str, exc: BaseException) -> None:
        n = self.hook_errors.get(hook, 0) + 1
        self.hook_errors[hook] = n
        if n <= 5:
            self.emit("hook.error", hook=hook, error=f"{type(exc).__name__}: {exc}"[:500])

    def set_role(self, role: str | None = None, inst: str | None = None, rank: int | None = None, why: str = "") -> None:
        changed = False
        if role and role != self.role:
            self.role, changed = role, True
        if inst and inst != self.inst and not self._inst_forced:
            self.inst, changed = inst, True
        if rank is not None and rank != self.rank:
            self.rank, changed = rank, True
        if changed:
            self.emit("proc.role", new_role=self.role, new_inst=self.inst, why=why)

    # -- writer side ------------------------------------------------------------------
    def _encode_frame(self, items: list[tuple]) -> bytes:
        """One shard frame for a batch of queued events (writer thread).

        The batch is marshalled as it sits in the queue, in one C call: about 0.2 us an
        event, against 2-3 us to build and serialize JSON objects. JSON is written once,
        off the traced process, when ``pdtrace record`` merges the shards
        (``pdtrace.record.shards.read_shard``). Deferred values (marked by put_deferred) are
        resolved here; a value marshal cannot take falls back to its JSON form."""
        for i, it in enumerate(items):
            fields = it[4]
            keys = fields.pop(DEFERRED_KEYS, None) if DEFERRED_KEYS in fields else None
            if keys:
                for k in keys:
                    v = fields.get(k)
                    if isinstance(v, Deferred):
                        fields[k] = _json_default(v)
        meta = (self.pid, self.role, self.inst, self.rank, self._wall_off)
        try:
            blob = marshal.dumps((meta, items), 4)
        except ValueError:  # an object marshal does not know: sanitize event by event
            safe = []
            for kind, t, req, step, fields in items:
                try:
                    marshal.dumps(fields, 4)
                except ValueError:
                    if kind == "sched.step":
                        unpack_step(fields)  # its JSON form is the schema's dicts
                    fields = orjson.loads(orjson.dumps(fields, default=_json_default,
                                                       option=orjson.OPT_NON_STR_KEYS))
                safe.append((kind, t, req, step, fields))
            blob = marshal.dumps((meta, safe), 4)
        return frame_head(len(blob), len(items), zlib.crc32(blob)) + blob

    def _materialize(self, items: Iterable[tuple]) -> list[dict]:
        return materialize((self.pid, self.role, self.inst, self.rank, self._wall_off), items)

    def flush(self) -> None:
        """Write what is queued (writer thread; ``close`` after the writer stopped). ``emitted``
        counts events written, ``dropped`` those lost to a full queue or a failed write."""
        q = self._q
        if not q or self._sink is None:
            return
        with self._flush_lock:  # close() after a writer that did not stop in time
            n = len(q)
            items = [q.popleft() for _ in range(n)]
            if not n:
                return
            try:
                self._sink(self._encode(items))
            except Exception as exc:  # disk full, closed file: count, never raise into the app
                self.dropped += n
                if not self._failing:  # once per failing spell, not once per flush
                    self._failing = True
                    print(f"pdtrace: writer failed for pid {self.pid}: {exc}; dropping events "
                          "(counted) until writes succeed again", file=sys.stderr)
            else:
                self.emitted += n
                if self._online is not None:
                    self._check_online(items)
                if self._failing:
                    self._failing = False
                    print(f"pdtrace: writer for pid {self.pid} writes again ({self.dropped} events "
                          "dropped so far)", file=sys.stderr)

    def _check_online(self, items: list[tuple]) -> None:
        """Flight recorder: the online rules over the batch just written; the first hit asks
        ``pdtrace record`` for a snapshot (``pdtrace.record.online``). Never raises."""
        try:
            hit = self._online.scan(items, self.inst)  # type: ignore[union-attr]
            if hit is not None:
                from . import online

                if online.trigger(self._online_dir, self.pid, self.inst, hit, self._wall_off):
                    print(f"pdtrace: [{self.inst} pid {self.pid}] online check: {hit[1]}; asking for a snapshot",
                          file=sys.stderr)
        except Exception as exc:  # the check is a convenience: never break the writer
            self._online = None
            print(f"pdtrace: online check disabled in pid {self.pid}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            self.flush()
        self.flush()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pdtrace-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Emit proc.exit, flush everything and stop the writer. Idempotent; a no-op in a
        process that inherited this recorder through fork (the parent owns its shard)."""
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # its last flush empties the queue
        # proc.exit carries the drop count: it bypasses the queue bound (``emit`` would drop
        # it exactly when drops happened), and is queued after the writer stopped, so the
        # counts it carries are final. ``events``: what this process wrote, proc.exit included.
        ring = getattr(self, "_ring", None)
        fields = {"events": self.emitted + len(self._q) + 1, "dropped": self.dropped,
                  "hook_errors": dict(self.hook_errors)}
        self._q.append(("proc.exit", _mono(), None, self.step, fields))
        if ring is not None:
            ring.frozen = True  # the last writes rotate nothing out: the count below is final
            fields["ring_discarded"] = ring.discarded
        self.flush()
        if ring is not None:
            ring.close()
        fh = getattr(self, "_fh", None)
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass

    def proc_start(self, session: str = "") -> None:
        from .redact import mask_argv

        self.emit("proc.start", argv=mask_argv(sys.argv), ppid=os.getppid(),
                  python=sys.version.split()[0], session=session)


def _close_in_mp_child(rec: "Recorder") -> None:
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:  # inside Process._bootstrap
        rec.close()


def start_process_recording(directory: str, session: str, redact: bool = True, **kw: Any) -> Recorder:
    """Start recording this process into ``directory`` (called by the bootstrap).

    A forked child gets its own shard and writer thread through the same path, keeping the
    parent's role, instance and rank until it learns its own."""

    def _start(**kwargs: Any) -> Recorder:
        rec = Recorder.to_shard_dir(directory, **kwargs)
        set_current(rec)
        rec.proc_start(session)
        atexit.register(rec.close)
        # multiprocessing children (vLLM's engine core and workers) end in Process._bootstrap ->
        # os._exit(): atexit never runs there, but threading._shutdown() does, and runs these.
        # Only there: elsewhere threading._shutdown() comes BEFORE atexit, and closing then would
        # lose what the program's own atexit handlers still record.
        try:
            threading._register_atexit(functools.partial(_close_in_mp_child, rec))  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # no such hook, or the process is already exiting
            pass
        return rec

    def _after_fork_in_child() -> None:
        old = get()
        if old is not None:
            _start(redact=old.redact, role=old.role, inst=old.inst, rank=old.rank,
                   ring_s=getattr(old, "ring_s", None))

    rec = _start(redact=redact, **kw)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    return rec
