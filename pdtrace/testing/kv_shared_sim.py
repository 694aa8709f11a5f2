"""Two requests sharing D's prefix-cache blocks, a failed load of those blocks, and chunked
prefill, through vLLM's real scheduler on CPU (issue 50, item 1).

What is real: D's ``Scheduler`` with the NIXL connector's scheduler side (``pd_harness``), its
prefix cache (r2 hits r1's first four blocks), chunked prefill with
``long_prefill_token_threshold``, and the whole failure path: ``update_from_output`` ->
``_handle_invalid_blocks`` -> ``_update_requests_with_invalid_blocks`` (policy ``recompute``),
which cuts the first request back to its first failed block and lets the second keep the shared
blocks as computed. What is simulated: the worker's report of the failed blocks in
``invalid_block_ids`` (as a connector that loads synchronously reports them, and as vLLM's own
tests drive the scheduler) and the sampled tokens.

The oracle is vLLM's own objects, never the detector: after the failure, at each step, whether
the scheduler's output scheduled r2 while r1's ``num_computed_tokens`` (after that step) had not
yet reached the end of a failed block r2 keeps as computed (each block's place in r1's own
block list).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .kv_load_sim import run_events
from .pd_harness import PDConfig, make_pair, recording
from .pd_steps import _make_request, _mro


@dataclasses.dataclass
class SharedLoad:
    events: list[dict]
    failure_step: int  # the step (sched.step's) whose output reported the failed blocks
    failed: list[int]  # the block ids reported
    kept: dict[str, int]  # request -> its computed tokens right after the failure was handled
    wrong: list[tuple[str, int]]  # (request, step): scheduled with a failed block it kept, not yet rewritten
    shared: bool = True  # r2 got r1's first four blocks from D's prefix cache (the shape needs it)


def shared_block_failure(long_prefill: int = 16, block_size: int = 16, steps_after: int = 6,
                         tag: str = "shared") -> SharedLoad:
    """r1 (80 tokens) is prefilled on D, then r2 (the same first 64 tokens, 16 of its own) hits
    r1's first four blocks in D's prefix cache; both decode; then blocks 1-3 of r1 (shared with
    r2) are reported failed. ``long_prefill``: the scheduler's long_prefill_token_threshold
    (0: vLLM's default, the recompute in one step). ``tag``: the request ids' prefix."""
    B = block_size
    cfg = PDConfig(spec_method="", block_size=B, kv_load_failure_policy="recompute", long_prefill=long_prefill,
                   max_num_batched_tokens=64)
    pair = make_pair(cfg)
    d, rec = pair.d, pair.rec
    prefix = [1000 + i for i in range(64)]
    r1 = _make_request(f"{tag}-1-D", prefix + [5000 + i for i in range(16)], 16, None, B)
    r2 = _make_request(f"{tag}-2-D", prefix + [7000 + i for i in range(16)], 16, None, B)
    rec.flush()
    start = len(rec.events or [])
    tok = [300]

    def step(**kvo: Any) -> Any:
        out = d.schedule()
        toks = {}
        for rid in out.num_scheduled_tokens:
            req = d.requests[rid]  # (schedule() counted the scheduled tokens as computed already)
            toks[rid] = [tok[0]] if req.num_computed_tokens >= req.num_prompt_tokens else []
            tok[0] += 1
        d.update_from_output(out, _mro(out, toks, **kvo))
        return out

    wrong: list[tuple[str, int]] = []
    with recording(rec):
        rec.emit("mark", label="scenario", sim=True,
                 detail=f"shared_block_failure long_prefill={long_prefill} block_size={B}")
        d.add_request(r1)
        n = 0
        while d.requests[r1.request_id].num_computed_tokens < 80 and n < 10:
            step()
            n += 1
        d.add_request(r2)
        for _ in range(3):
            step()
            n += 1
        b1 = list(d.kv_cache_manager.get_block_ids(r1.request_id)[0])
        shared = list(d.kv_cache_manager.get_block_ids(r2.request_id)[0])[:4] == b1[:4]
        failed = b1[1:4]  # shared with r2 (its prefix-cache hit)
        step(invalid_block_ids=set(failed))
        n += 1
        failure_step = n - 1
        kept = {r.request_id: d.requests[r.request_id].num_computed_tokens for r in (r1, r2)}
        for _ in range(steps_after):
            out = step()
            n += 1
            c1 = d.requests[r1.request_id].num_computed_tokens if r1.request_id in d.requests else 1 << 30
            b2 = list(d.kv_cache_manager.get_block_ids(r2.request_id)[0]) if r2.request_id in d.requests else []
            kept2 = kept[r2.request_id]
            stale = [b for i, b in enumerate(b2) if b in failed and i * B < kept2 and c1 < (b1.index(b) + 1) * B]
            if r2.request_id in out.num_scheduled_tokens and stale:
                wrong.append((r2.request_id, n - 1))
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    events = run_events(pair, start)
    steps = [e["step"] for e in events if e["ev"] == "sched.step" and e.get("inst") == "D"]
    base = steps[0] if steps else 0  # the hooks' step numbers: schedule() calls of this scheduler
    return SharedLoad(events, base + failure_step, failed, kept, [(r, base + k) for r, k in wrong], shared)


def scenario(long_prefill: int) -> Any:
    """The sample pair's builder (``scenarios.SCENARIOS``): expected findings from vLLM's objects
    (``SharedLoad.wrong``), never from the detector."""
    def build() -> Any:
        from pdtrace.detectors.base import KV_INVARIANT, KV_LOAD_FAILURE_RECOVERY

        from .scenario_builders import REAL_KV_LOAD, SIM_KV_SYNC, Scenario

        r = shared_block_failure(long_prefill)
        # (read before the rewrite: a step attended to a failed load's KV, the invariant's error too)
        return Scenario("", "", r.events, [KV_LOAD_FAILURE_RECOVERY, KV_INVARIANT] if r.wrong else [], {
            "real": [REAL_KV_LOAD + "; its prefix cache (the second request hits the first's blocks) and "
                     "chunked prefill (SchedulerConfig.long_prefill_token_threshold)"],
            "simulated": [SIM_KV_SYNC], "faults": [], "fixture": [],
            "own_bug": ("vLLM 0.32.0's own _update_requests_with_invalid_blocks: the second request keeps the "
                        "shared failed blocks as computed and is scheduled before the first rewrites them") if r.wrong
            else "",
            "clean_twin": "" if r.wrong else ("vLLM 0.32.0 as released with its default scheduler config (no "
                                              "long_prefill_token_threshold): the same code, nothing read early"),
            "facts": {"long_prefill_token_threshold": long_prefill, "failed_blocks": r.failed,
                      "computed_after": r.kept, "read_before_rewrite": [list(x) for x in r.wrong]},
        }, [])
    return build
