"""A KV load that fails on D, through real vLLM code on CPU (issue 36).

What is real: P's and D's ``Scheduler`` (or ``AsyncScheduler``) with the NIXL connector's
scheduler side (``pd_harness``), the scheduler's whole failure path
(``update_from_output`` -> ``_handle_failed_recving`` / ``_handle_invalid_blocks`` ->
``_update_requests_with_invalid_blocks``, eviction, rescheduling, failing the request), and
D's NIXL worker's own ``_log_failure`` and ``get_block_ids_with_load_errors`` (on a worker built
with ``object.__new__`` and given only what those two read: ``engine_id``,
``_recving_metadata``, the ``_invalid_block_ids`` queue).

What is simulated, as the worker does it in vLLM 0.32.0 (``base_worker.get_transfer_results``):
the read fails; the worker logs it, queues the request's local blocks of group 0 as invalid, and
the next ``KVConnectorOutput`` carries the request in ``finished_recving`` and (vLLM 0.30+)
``failed_recving``, and the blocks in ``invalid_block_ids``. ``how``: "blocks" sends only the
blocks (what a release before ``failed_recving`` reports), "both" sends both (0.30+).

``rolled_back_placeholders`` (a LABELLED fixture, not vLLM 0.32.0's code): the approach of vLLM
PRs #45430 / #49252 (not merged in 0.32.0 / 0.33.0), which reset an affected request's
``num_output_placeholders`` when its computed tokens are cut back; the fixed run beside the
release's own.

The oracle is vLLM's own state, read from its objects: D's local blocks for the request (the
blocks that failed), the request's ``num_computed_tokens`` right after the failure was handled,
what the scheduler scheduled next, and whether the request finished (and how).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import queue
from typing import Any, Iterator

from .pd_harness import PDConfig, make_pair, recording
from .pd_nixl import _pull_worker_cls
from .pd_steps import _make_request, _mro, _step, p_prefill

HOWS = ("blocks", "both")
WHENS = ("load", "running")
_ids = itertools.count(1)


@dataclasses.dataclass
class FailedLoad:
    events: list[dict]  # the pair's setup events and this run's, ids assigned in order
    d_req: str
    policy: str
    how: str
    prompt_len: int
    d_local: list[int]  # D's blocks for the request (group 0): what the failed read was to fill
    computed_after: int | None  # num_computed_tokens right after the failure was handled
    num_tokens_after: int | None  # the request's num_tokens then (what a recompute has to cover)
    scheduled_after: list[int]  # tokens D scheduled for the request on each later step
    finished: str | None  # the request's status when it left D (None: still there at the end)
    raised: str | None = None  # vLLM's scheduler raised handling the failure ('Type: message'): engine dead

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == kind]


def _worker(engine_id: str) -> Any:
    w = object.__new__(_pull_worker_cls())
    w.engine_id = engine_id
    w._recving_metadata = {}
    # the release's own container for failed blocks: a queue (0.2x+: drained by
    # get_block_ids_with_load_errors) or a set (0.19: swapped for a new one)
    src = inspect.getsource(type(w).get_block_ids_with_load_errors)
    w._invalid_block_ids = queue.Queue() if "get_nowait" in src else set()
    return w


def _queue_invalid(worker: Any, blocks: set[int]) -> None:
    """What the worker does for a failed read: its local blocks (group 0) into the container."""
    if isinstance(worker._invalid_block_ids, set):
        worker._invalid_block_ids.update(blocks)
    else:
        worker._invalid_block_ids.put(set(blocks))


@contextlib.contextmanager
def patched_rollback(scheduler: Any, rec: Any, detail: str, after: Any) -> Iterator[None]:
    """A LABELLED fixture: this scheduler's ``_update_requests_with_invalid_blocks`` runs as the
    release has it, then ``after(request)`` for each request it affected; a ``mark`` says so."""
    orig = scheduler._update_requests_with_invalid_blocks

    def fixed(requests: Any, *args: Any, **kw: Any) -> Any:
        requests = list(requests)
        affected, tokens, evict = orig(requests, *args, **kw)
        for r in requests:
            if r.request_id in affected:
                after(r)
        return affected, tokens, evict

    rec.emit("mark", label="fixture", sim=True, inst="D", detail=detail)
    scheduler._update_requests_with_invalid_blocks = fixed
    try:
        yield
    finally:
        del scheduler._update_requests_with_invalid_blocks  # back to the class method


def rolled_back_placeholders(scheduler: Any, rec: Any) -> Any:
    """LABELLED fixture: this scheduler's ``_update_requests_with_invalid_blocks`` also resets
    the affected requests' ``num_output_placeholders`` (vLLM PR #45430's rule, for #45138 /
    #49250), so a recompute is scheduled only what the request has left."""
    def reset(r: Any) -> None:
        r.num_output_placeholders = 0

    return patched_rollback(scheduler, rec, "LABELLED FIX (not in vLLM 0.32.0): _update_requests_with_invalid_blocks "
                                            "resets the affected requests' num_output_placeholders (vLLM PR #45430 / "
                                            "#49252)", reset)


def _has_failed_recving() -> bool:
    from vllm.v1.outputs import KVConnectorOutput

    return "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}


def run_events(pair: Any, start: int) -> list[dict]:
    """The pair's setup events and the run's (the recorder's events from ``start``), with ids as a
    written trace gives them: the detectors name events by id."""
    return [dict(e, id=i) for i, e in enumerate([*pair.setup_events, *(pair.rec.events or [])[start:]])]


def failed_load(cfg: PDConfig = PDConfig(spec_method=""), *, policy: str = "fail", how: str = "both",
                prompt_len: int = 64, steps: int = 6, failed: tuple[int, ...] | None = None,
                when: str = "load", max_tokens: int = 4, fix_placeholders: bool = False,
                rec: Any = None) -> FailedLoad:
    """One disaggregated request whose KV load fails on D; then D runs ``steps`` steps.

    ``failed``: the indices of D's blocks (group 0) reported invalid (default: all of them, as
    NIXL's worker reports a failed read). ``when``: "load" (the read fails: NIXL's async load)
    or "running" (the load succeeds, the request runs one step, then its blocks are reported
    invalid, as a connector that loads synchronously reports them, and as vLLM's own tests
    drive the scheduler; only ``invalid_block_ids``). ``fix_placeholders``: run D under the
    labelled ``rolled_back_placeholders`` fixture."""
    if how not in HOWS:
        raise ValueError(f"unknown how {how!r}; one of {HOWS}")
    if when not in WHENS:
        raise ValueError(f"unknown when {when!r}; one of {WHENS}")
    if how == "both" and not _has_failed_recving():
        how = "blocks"  # (this release has no failed_recving: its NIXL worker reports blocks only)
    cfg = dataclasses.replace(cfg, kv_load_failure_policy=policy)
    pair = make_pair(cfg, rec)
    rec = pair.rec
    n = next(_ids)
    p_req, d_req = f"load-{n}-P", f"load-{n}-D"
    prompt = [900 + (n * 31 + i) % 3000 for i in range(prompt_len)]
    rec.flush()
    start = len(rec.events or [])
    computed_after, num_tokens_after, scheduled, finished = None, None, [], None
    with contextlib.ExitStack() as stack:
        stack.enter_context(recording(rec))
        if fix_placeholders:
            stack.enter_context(rolled_back_placeholders(pair.d, rec))
        rec.emit("mark", label="scenario", sim=True,
                 detail=f"failed_load {cfg.label()} policy={policy} how={how} when={when} failed={failed} "
                        f"prompt_len={prompt_len}")
        params = p_prefill(pair.p, p_req, prompt, cfg.block_size)
        dr = _make_request(d_req, prompt, max_tokens, dict(params), cfg.block_size)
        pair.d.add_request(dr)
        out_d = pair.d.schedule()
        pair.d.update_from_output(out_d, _mro(out_d, {}))
        d_local = list(pair.d.kv_cache_manager.get_block_ids(d_req)[0])
        bad = set(d_local) if failed is None else {d_local[i] for i in failed}
        tok = 300
        raised = None
        worker = _worker(str(getattr(pair.d.connector, "engine_id", "D")))
        if when == "load":  # D's worker: the read fails (the real _log_failure, get_block_ids_with_load_errors)
            worker._log_failure(failure_type="transfer_failed", req_id=d_req, msg="simulated: the NIXL read failed",
                                error=RuntimeError("NIXL_ERR_REMOTE_DISCONNECT (simulated)"))
            _queue_invalid(worker, bad)
            kvo = {"finished_recving": {d_req}, "invalid_block_ids": worker.get_block_ids_with_load_errors()}
            if how == "both":
                kvo["failed_recving"] = {d_req}
            try:
                _step(pair.d, None, 0, **kvo)
            except Exception as exc:  # vLLM's scheduler raised on the failure: its engine core would exit
                raised = f"{type(exc).__name__}: {exc}"[:300]
        else:  # the load completes, the request runs a step; then its blocks are reported invalid
            _step(pair.d, None, 0, finished_recving={d_req})
            _step(pair.d, d_req, tok)
            tok += 2
            _queue_invalid(worker, bad)
            _step(pair.d, d_req, tok, invalid_block_ids=worker.get_block_ids_with_load_errors())
            tok += 2
        req = pair.d.requests.get(d_req)
        computed_after = req.num_computed_tokens if req is not None and raised is None else None
        num_tokens_after = req.num_tokens if req is not None else None
        for _ in range(steps if raised is None else 0):
            out, _eco = _step(pair.d, d_req, tok)
            scheduled.append(out.num_scheduled_tokens.get(d_req, 0))
            tok += 2
            if d_req not in pair.d.requests:
                break
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    events = run_events(pair, start)
    fin = [e for e in events if e["ev"] == "req.finish" and e.get("req") == d_req]
    finished = fin[-1]["status"] if fin else None
    return FailedLoad(events, d_req, policy, how, prompt_len, d_local, computed_after, num_tokens_after, scheduled,
                      finished, raised)
