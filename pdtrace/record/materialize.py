"""What the recorder's writer thread and the merge do with queued events: ``Deferred``
values resolved off the caller's thread, the packed fields hooks queue (``GROW``,
``PROMPT``, packed ``sched.step``), and ``materialize`` turning a shard frame's tuples back
into schema events. Importable from ``pdtrace.record.recorder`` too."""

from __future__ import annotations

from typing import Any, Iterable

from .redact import digest_hash


class Deferred:
    """A field value whose JSON form is computed on the writer thread, not the caller's.

    A hook on a per-step path snapshots what it needs cheaply (e.g. copies of vLLM's block
    lists, whose block objects have fixed ids) and wraps it in a subclass; the writer calls
    ``json()`` when it serializes the event. The snapshot must not change after ``put``
    (copy anything vLLM may mutate later)."""

    __slots__ = ()

    def json(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def _json_default(obj: Any) -> Any:
    """orjson's fallback, called only for values it cannot serialize itself. Never raises:
    an odd value from a hook becomes a string rather than losing the writer's batch."""
    if isinstance(obj, Deferred):
        try:
            return obj.json()
        except Exception as exc:
            return f"<pdtrace: {type(obj).__name__} failed: {type(exc).__name__}: {exc}>"[:300]
    if hasattr(obj, "__index__"):
        return obj.__index__()  # numpy / torch integer scalars
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if hasattr(obj, "__float__"):
        return float(obj)
    return repr(obj)[:300]


# Shard frames: see pdtrace.record.frames (format, writer loop, reader with resynchronisation).
DEFERRED_KEYS = "\x00deferred"  # fields key put_deferred uses to name its Deferred values
# sched.step fields key: (t0, num_lookahead_tokens, [(req, num_computed_tokens, new_block_ids
# per group), ...]), the blocks that step appended to running requests, read from its
# SchedulerOutput (hooks/scheduler.py). ``materialize`` turns each row into a short
# sched.alloc (``from_output: true``) timed t0; the key itself is never written.
GROW = "\x00grow"
# req.add fields key: ``redact.token_digest`` of the prompt (CPython's tuple hash, taken on
# the caller's thread); ``materialize`` replaces it with the schema's ``prompt_hash``
# (``redact.digest_hash``, blake2b), so the traced process never runs blake2b. Never written.
PROMPT = "\x00prompt"
# sched.step ``tokens`` / ``spec`` as queued by the scheduler hook: packed forms that cost the
# caller and the writer less than 256-entry dicts; ``unpack_step`` restores the dicts.
#   tokens: (request ids, counts)          -> {req: count}
#   spec:   (request ids or None, lengths) -> {req: length}; None: the same ids as tokens
# counts / lengths are ``bytes`` (one byte per request) when every value is < 256, else a list.


def materialize(meta: tuple, items: Iterable[tuple]) -> list[dict]:
    """Queued ``(kind, t, req, step, fields)`` tuples -> event dicts, given the process's
    ``(pid, role, inst, rank, wall_offset_ns)`` (the in-memory sink, and shard frames read
    back by ``pdtrace.record.shards``). Fields may override the common ones (e.g. ``inst``). A
    sched.step carrying ``GROW`` is preceded by the sched.alloc events it stands for; a
    ``PROMPT`` digest becomes ``prompt_hash``."""
    pid, role, inst, rank, off = meta
    out = []
    for kind, t, req, step, fields in items:
        ev = {"ev": kind, "t": t, "w": t + off, "pid": pid, "role": role, "inst": inst}
        if rank is not None:
            ev["rank"] = rank
        if step is not None:
            ev["step"] = step
        if req is not None:
            ev["req"] = req
        grow = fields.pop(GROW, None) if GROW in fields else None
        if kind == "sched.step":
            unpack_step(fields)
        elif PROMPT in fields:
            fields["prompt_hash"] = digest_hash(fields.pop(PROMPT))
        ev.update(fields)
        if grow is not None:
            out.extend(_grow_allocs(ev, grow, off))
        out.append(ev)
    return out


def unpack_step(fields: dict) -> dict:
    """A queued sched.step's packed ``tokens`` / ``spec`` (the forms described after ``GROW``)
    back to the schema's dicts, in place (a dict value is left as it is)."""
    tok = fields.get("tokens")
    if type(tok) is tuple:
        keys, counts = tok
        fields["tokens"] = dict(zip(keys, counts))
        spec = fields.get("spec")
        if type(spec) is tuple:
            skeys, lens = spec
            fields["spec"] = dict(zip(keys if skeys is None else skeys, lens))
    return fields


def _grow_allocs(step_ev: dict, grow: Any, off: int) -> list[dict]:
    """The short sched.alloc events (schema v2: new_block_ids, no block_ids) of one step's
    running requests, from its ``GROW`` value (see there)."""
    t0, lookahead, rows = grow
    tokens = step_ev.get("tokens") or {}
    common = {"ev": "sched.alloc", "t": t0, "w": t0 + off}
    for k in ("pid", "role", "inst", "rank", "step"):
        if k in step_ev:
            common[k] = step_ev[k]
    out = []
    for req, computed, blocks in rows:
        ev = dict(common)
        ev.update(req=req, ok=True, new_block_ids=[list(g) for g in blocks], num_computed_tokens=computed,
                  num_new_tokens=tokens.get(req, 0), num_lookahead_tokens=lookahead, from_output=True)
        out.append(ev)
    return out


def _resolve_deferred(ev: dict) -> dict:
    keys = ev.pop(DEFERRED_KEYS, None)
    for k in keys or ():
        if isinstance(ev.get(k), Deferred):
            ev[k] = _json_default(ev[k])
    return ev
