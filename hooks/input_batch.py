"""Hooks on the worker's persistent batch (``vllm.v1.worker.gpu_input_batch.InputBatch``).

Rows of the InputBatch move between steps (``swap_states`` during attention-backend
reorder, ``condense`` after removals). Per-row CPU buffers that an in-flight non-blocking
D2H copy targets (``num_accepted_tokens_cpu_tensor``) do not follow those moves, which is
bug class 004; these events let a detector replay which request sat in which row when.

InputBatch is plain Python + CPU tensors: it builds and runs on a CPU-only machine with
``device=torch.device("cpu")``, so these hooks are live on CPU (tests drive the real class).

Verified against vLLM 0.32.0 ``v1/worker/gpu_input_batch.py``:
``add_request(self, request) -> int``, ``remove_request(self, req_id) -> int | None``,
``swap_states(self, i1, i2) -> None``, ``condense(self) -> None``.
"""

from __future__ import annotations

from typing import Any

from pdtrace.hooks import after, around, register
from pdtrace.hooks.accepted_counts import _observe_done, _query, note_move, outstanding, report_done

MODULE = "vllm.v1.worker.gpu_input_batch"


# Where an in-flight accepted-count copy landed relative to a row move (vLLM #51571): the
# copy's event is queried (non-blocking, never synchronized) just before and just after the
# move. Done before: the copy landed first (d2h.done is emitted before the move's event, and
# the move carries the fresh counts with the rows). Not done after: it lands later, into the
# rows as they were at issue. Neither: it landed while the move ran ("unknown").
def _landed_before(rec: Any, ib: Any) -> Any:
    st = outstanding(ib)
    if st is None or _observe_done(rec, st, st.event):
        return None  # no copy in flight, or d2h.done now in the trace, before this move
    return st


def _finish_move(rec: Any, ib: Any, st: Any, kind: str, req: Any, fields: dict) -> None:
    """Record a move; with ``st`` (a copy in flight before it), where the copy landed."""
    done = False
    if st is not None:
        q = _query(st.event)  # None: an event without query(): the order cannot be told
        done = bool(q)
        fields["copy"] = st.event_id
        fields["landed"] = "after" if q is False else "unknown"
    note_move(ib)
    rec.put(kind, req, None, fields)
    if done:
        report_done(rec, st)


def _add_before(rec: Any, self: Any, request: Any, *a: Any, **kw: Any) -> Any:
    return _landed_before(rec, self)


def _rec_add(rec: Any, o: Any, result: Any, self: Any, request: Any, *a: Any, **kw: Any) -> None:
    if result is None and request.req_id not in self.req_id_to_index:
        return  # the original raised
    req_id = request.req_id
    row = result if isinstance(result, int) else self.req_id_to_index.get(req_id, -1)
    _finish_move(rec, self, o, "batch.add", req_id, {"row": int(row)})


def _rec_remove(rec: Any, result: Any, self: Any, req_id: str, *a: Any, **kw: Any) -> None:
    rec.put("batch.remove", req_id, None, {"row": -1 if result is None else int(result)})


def _swap_before(rec: Any, self: Any, i1: int, i2: int, *a: Any, **kw: Any) -> tuple:
    ids = self._req_ids
    return (ids[i1] or "", ids[i2] or "", _landed_before(rec, self))


def _swap_after(rec: Any, state: Any, result: Any, self: Any, i1: int, i2: int, *a: Any, **kw: Any) -> None:
    if state is None:
        return
    _finish_move(rec, self, state[2], "batch.swap", None,
                 {"i1": int(i1), "i2": int(i2), "req1": state[0], "req2": state[1]})


def _condense_before(rec: Any, self: Any, *a: Any, **kw: Any) -> tuple | None:
    # condense() returns at once when nothing was removed: skip the snapshot then.
    if not self.batch_update_builder.removed:
        return None
    return (list(self._req_ids), _landed_before(rec, self))


def _condense_after(rec: Any, state: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if state is None:
        return
    state, o = state
    old_rows = {r: i for i, r in enumerate(state) if r is not None}
    moves = []
    for new_row, req in enumerate(self._req_ids):
        if req is None:
            continue
        old = old_rows.get(req)
        if old is not None and old != new_row:
            moves.append([req, old, new_row])
    if moves:
        _finish_move(rec, self, o, "batch.condense", None, {"moves": moves})


ADD = register("input_batch.add", MODULE, "InputBatch.add_request", ("request",),
               around("input_batch.add", _add_before, _rec_add),
               doc="batch.add: request id + row (+ where an in-flight accepted-count copy landed)", runner="v1")
REMOVE = register("input_batch.remove", MODULE, "InputBatch.remove_request", ("req_id",),
                  after("input_batch.remove", _rec_remove), doc="batch.remove: request id + row", runner="v1")
SWAP = register("input_batch.swap", MODULE, "InputBatch.swap_states", ("i1", "i2"),
                around("input_batch.swap", _swap_before, _swap_after),
                doc="batch.swap: rows and the request ids in them before the swap", runner="v1")
CONDENSE = register("input_batch.condense", MODULE, "InputBatch.condense", (),
                    around("input_batch.condense", _condense_before, _condense_after),
                    doc="batch.condense: [req, old_row, new_row] per moved request", runner="v1")

SPECS = (ADD, REMOVE, SWAP, CONDENSE)
