"""Stepping ``pd_harness``'s real schedulers without a model: real ``Request`` objects, the
schedule / update-from-output loop with sampled tokens fed back through a real
``ModelRunnerOutput`` (``drive``, ``_step``), and the kv_transfer_params P hands to D."""

from __future__ import annotations

from typing import Any, Iterator


def _make_request(rid: str, prompt: list[int], max_tokens: int, kv: dict | None, block_size: int) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))
    r.kv_transfer_params = kv
    return r


def drive(sched: Any, draft_k: int = 0, max_steps: int = 10_000) -> int:
    """Steps a Scheduler until it has no requests (or ``max_steps``); returns the steps.

    Each step: schedule(), a ModelRunnerOutput that samples one token per request that
    finished its prompt this step (two, i.e. one draft accepted, when drafts were scheduled
    for it; none for a partial prefill chunk), update_from_output(), and with ``draft_k``
    drafts of that length for every running request past its prompt
    (update_draft_token_ids). No model runs: the scheduler, KV cache manager and connector
    scheduler side are vLLM's own."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    steps = 0
    while sched.has_requests() and steps < max_steps:
        out = sched.schedule()
        spec = out.scheduled_spec_decode_tokens
        ids, toks = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests.get(rid)
            if req is None:
                continue
            ids.append(rid)
            if req.num_computed_tokens + out.num_scheduled_tokens[rid] < req.num_prompt_tokens:
                toks.append([])  # partial prefill: nothing sampled
            else:
                toks.append([5, 6] if spec.get(rid) else [5])
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=toks))
        if draft_k:
            running = [r.request_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
            if running:
                sched.update_draft_token_ids(DraftTokenIds(running, [[7] * draft_k for _ in running]))
        steps += 1
    return steps


def _mro(sched_out: Any, tokens: dict[str, list[int]], finished_sending: set | None = None,
         finished_recving: set | None = None, invalid_block_ids: set | None = None,
         failed_recving: set | None = None) -> Any:
    """The ModelRunnerOutput a worker would return; a load failure as D's NIXL worker reports it
    (``invalid_block_ids``: get_block_ids_with_load_errors; ``failed_recving``: vLLM 0.30+)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = [r for r in sched_out.num_scheduled_tokens if r in tokens]
    kvo = None
    if finished_sending or finished_recving or invalid_block_ids or failed_recving:
        kvo = KVConnectorOutput(finished_sending=finished_sending or None, finished_recving=finished_recving or None)
        if invalid_block_ids:
            kvo.invalid_block_ids = set(invalid_block_ids)
        if failed_recving:
            kvo.failed_recving = set(failed_recving)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[tokens[r] for r in ids], kv_connector_output=kvo)


def _tokens_for(sched_out: Any, req_id: str, next_tok: int) -> dict[str, list[int]]:
    """Sampled tokens for a scheduled request: accept the first draft token, if any."""
    if req_id not in sched_out.num_scheduled_tokens:
        return {}
    n_spec = len(sched_out.scheduled_spec_decode_tokens.get(req_id, ()))
    return {req_id: [next_tok, next_tok + 1] if n_spec else [next_tok]}


def _step(sched: Any, req_id: str | None, next_tok: int, **kvo: Any) -> tuple[Any, dict]:
    out = sched.schedule()
    toks = _tokens_for(out, req_id, next_tok) if req_id else {}
    req = sched.requests.get(req_id) if req_id else None
    if toks and req is not None and req.num_computed_tokens < req.num_prompt_tokens:
        toks = {req_id: []}  # a partial prefill chunk (schedule() already counted it): nothing sampled
    eco = sched.update_from_output(out, _mro(out, toks, **kvo))
    return out, eco


def p_prefill(sched: Any, p_req: str, prompt: list[int], block_size: int) -> dict:
    """P's side of a disaggregated request: add it (do_remote_decode), schedule, feed one sampled
    token until P's real ``_connector_finished`` / ``request_finished`` give kv_transfer_params."""
    pr = _make_request(p_req, prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}, block_size)
    sched.add_request(pr)
    for _ in range(8):
        _out, eco = _step(sched, p_req, 100)
        params = _kv_params_from(eco, p_req)
        if params is not None:
            return params
    raise RuntimeError("P did not finish the request / produced no kv_transfer_params")


def _kv_params_from(eco: dict, req_id: str) -> dict | None:
    for outs in eco.values():
        for o in outs.outputs:
            if o.request_id == req_id and o.kv_transfer_params:
                return dict(o.kv_transfer_params)
    return None


def engine_order(sched: Any, iterations: int) -> Iterator[tuple[int, str, Any, int, Any]]:
    """EngineCore.step_with_batch_queue's order under async scheduling (a batch queue of two): each iteration
    schedules a step while the scheduler has requests, then hands back the oldest scheduled step's output to be
    processed once two are queued (or once nothing more is scheduled). Yields (iteration, "scheduled" or "output",
    the scheduler output, its step, the queue of (output, step) newest first, the yielded output already popped);
    the caller runs update_from_output for each "output"."""
    import collections

    from pdtrace.hooks.scheduler import sched_step

    queue: collections.deque = collections.deque()
    for i in range(iterations):
        if sched.has_requests():
            out = sched.schedule()
            step = sched_step(sched)
            queue.appendleft((out, step))
            yield i, "scheduled", out, step, queue
            if len(queue) < 2:
                continue
        if not queue:
            return
        old, step = queue.pop()
        yield i, "output", old, step, queue
