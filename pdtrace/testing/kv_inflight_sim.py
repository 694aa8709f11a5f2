"""The step in flight at a KV-load rollback, under async scheduling, in EngineCore's real order,
through vLLM's real scheduler on CPU (issue 50, item 2).

EngineCore's ``step_with_batch_queue`` (async scheduling: a batch queue of two) schedules step
n+1 before it processes step n's output. When step n's output reports a running request's
blocks as failed (a connector that loads synchronously; vLLM's own tests report them so), the
scheduler cuts the request back (policy "recompute") and drops step n's output for it; but step
n+1 was already scheduled, ran on the failed KV, and its sampled token is appended when its
output is processed after the rollback (``_update_request_with_output``: nothing marks that
output stale). Every release 0.19-0.33 behaves so.

What is real: P's and D's ``AsyncScheduler`` with the NIXL connector's scheduler side
(``pd_harness``), the failure path (``update_from_output`` -> ``_handle_invalid_blocks`` ->
``_update_requests_with_invalid_blocks``) and the output processing that appends the token.
What is simulated: the engine core's loop order (schedule, then process the oldest output, as
``step_with_batch_queue`` does), the report of the failed blocks, and the sampled tokens (each
step samples a distinct token id, so the oracle can tell which step's token reached the output).

``discard_in_flight`` (a LABELLED fixture, not in any release): at the rollback, mark the
request's in-flight output stale and to be dropped (``drop_stale_output`` /
``num_stale_output_tokens``, the mechanism vLLM 0.32+ already applies to preempted and resumed
requests), so the in-flight token is dropped; the fixed run beside the release's own.

The oracle is vLLM's own request object: its ``output_token_ids`` after each output is processed
(the token sampled by the step in flight is, or is not, among them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from pdtrace.hooks.scheduler import sched_step  # the step the schedule hook numbered

from .kv_load_sim import _queue_invalid, _worker, patched_rollback, run_events
from .pd_harness import PDConfig, make_pair, recording
from .pd_steps import _make_request, _mro, _step, engine_order, p_prefill


@dataclasses.dataclass
class InFlight:
    events: list[dict]
    d_req: str
    rollback_step: int  # the latest step scheduled when the failure was handled
    in_flight_step: int  # the step scheduled before the rollback whose output came after it
    in_flight_token: int  # the token id that step sampled
    appended: bool  # oracle: vLLM's request holds that token in its output
    output: list[int]  # the request's output_token_ids at the end


def discard_in_flight(scheduler: Any, rec: Any) -> Any:
    """LABELLED fixture: the rollback also marks the affected requests' in-flight output stale
    and to be dropped (vLLM 0.32+'s ``drop_stale_output``; not done for a KV-load rollback by
    any release)."""
    def drop(r: Any) -> None:
        r.drop_stale_output = True
        r.num_stale_output_tokens = r.num_in_flight_tokens

    return patched_rollback(scheduler, rec, "LABELLED FIX (not in any vLLM release): a KV-load rollback drops the "
                                            "request's in-flight output (drop_stale_output / num_stale_output_tokens, "
                                            "as vLLM 0.32+ does on preemption)", drop)


def discard_in_flight_and_placeholders(scheduler: Any, rec: Any) -> Any:
    """LABELLED fixture: ``discard_in_flight`` and the placeholders reset of vLLM PRs #45430 / #49252 together (the
    clean twin of a rollback with a step in flight: neither is in any release)."""
    def drop(r: Any) -> None:
        r.drop_stale_output = True
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0

    return patched_rollback(scheduler, rec, "LABELLED FIX (not in any vLLM release): a KV-load rollback drops the "
                                            "request's in-flight output (as vLLM 0.32+ does on preemption) and resets "
                                            "its output placeholders (vLLM PRs #45430 / #49252)", drop)


def in_flight_rollback(*, fix: bool | str = False, prompt_len: int = 64, failed: tuple[int, ...] = (2,),
                       max_tokens: int = 8, steps: int = 10, tag: str = "inflight") -> InFlight:
    """One disaggregated request on D's AsyncScheduler: loaded, decoding in the engine's order;
    its blocks ``failed`` (indices of its group-0 blocks) reported failed in step n's output
    while step n+1 is in flight; then D runs on (``steps`` engine iterations). ``tag``: the
    request ids' prefix. ``fix``: True runs D under ``discard_in_flight``; "both" under
    ``discard_in_flight_and_placeholders``."""
    cfg = PDConfig(spec_method="", async_scheduling=True, kv_load_failure_policy="recompute")
    pair = make_pair(cfg)
    rec, d = pair.rec, pair.d
    prompt = [1300 + i % 2000 for i in range(prompt_len)]
    p_req, d_req = f"{tag}-P", f"{tag}-D"
    rec.flush()
    start = len(rec.events or [])
    sampled: dict[int, int] = {}  # step -> the token its output carries for the request
    with contextlib.ExitStack() as stack:
        stack.enter_context(recording(rec))
        if fix:
            stack.enter_context((discard_in_flight_and_placeholders if fix == "both" else discard_in_flight)(d, rec))
        rec.emit("mark", label="scenario", sim=True,
                 detail=f"in_flight_rollback fix={fix} failed={failed} prompt_len={prompt_len} (engine order)")
        params = p_prefill(pair.p, p_req, prompt, cfg.block_size)
        req = _make_request(d_req, prompt, max_tokens, dict(params), cfg.block_size)
        d.add_request(req)
        out = d.schedule()
        d.update_from_output(out, _mro(out, {}))
        _step(d, None, 0, finished_recving={d_req})  # the load completed
        worker = _worker(str(getattr(d.connector, "engine_id", "D")))
        rollback_step = in_flight_step = -1
        for i, kind, old, step, queue in engine_order(d, steps + 3):
            if kind != "output":
                continue
            toks = {}
            if d_req in old.num_scheduled_tokens:
                toks = {d_req: [5000 + step]}
                sampled[step] = 5000 + step
            kvo = {}
            if i == 2:  # step n's output reports the failed blocks; step n+1 is in the queue
                blocks = list(d.kv_cache_manager.get_block_ids(d_req)[0])
                _queue_invalid(worker, {blocks[j] for j in failed})
                kvo["invalid_block_ids"] = worker.get_block_ids_with_load_errors()
                rollback_step, in_flight_step = sched_step(d), queue[-1][1] if queue else -1
            d.update_from_output(old, _mro(old, toks, **kvo))
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    output = list(req.output_token_ids)
    token = sampled.get(in_flight_step, -1)
    return InFlight(run_events(pair, start), d_req, rollback_step, in_flight_step, token, token in output, output)


def scenario(fix: bool) -> Any:
    """The sample pair's builder (``scenarios.SCENARIOS``): vLLM 0.32.0 as released (its own bug, open upstream), and
    beside it the labelled fix of both (``discard_in_flight_and_placeholders``). Expected findings from vLLM's request
    object (``InFlight.appended``), never from the detector."""
    def build() -> Any:
        from pdtrace.detectors.base import KV_INVARIANT, KV_LOAD_FAILURE_RECOVERY

        from .scenario_builders import REAL_KV_LOAD, SIM_KV_SYNC, Scenario

        r = in_flight_rollback(fix="both" if fix else False, tag="inflight")
        own = ("vLLM 0.32.0's own AsyncScheduler in the engine core's order: the output of the step in flight at the "
               "rollback is appended after it (nothing marks it stale), and the rollback keeps the output "
               "placeholders (open upstream: #49250, #45138)")
        fixture = ("LABELLED FIX (not in vLLM 0.32.0): the rollback drops the request's in-flight output "
                   "(drop_stale_output, as vLLM 0.32+ does on preemption) and resets its output placeholders (vLLM "
                   "PRs #45430 / #49252)")
        return Scenario("", "", r.events, [KV_LOAD_FAILURE_RECOVERY, KV_INVARIANT] if r.appended else [], {
            "real": [REAL_KV_LOAD], "faults": [], "fixture": [fixture] if fix else [],
            "simulated": [SIM_KV_SYNC, "the engine core's order under async scheduling (EngineCore."
                          "step_with_batch_queue: step n+1 scheduled before step n's output is processed)"],
            "own_bug": "" if fix else own,
            "facts": {"appended": r.appended, "in_flight_step": r.in_flight_step, "rollback_step": r.rollback_step,
                      "output": r.output},
        }, [KV_INVARIANT])  # (as the rollback pair: no NIXL read recorded on D, so most reads cannot be judged)
    return build
