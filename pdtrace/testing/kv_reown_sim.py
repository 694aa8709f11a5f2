"""A block handed to a KV load while a step in flight still writes it (vLLM #37285, fixed by PR #45357), through
vLLM's real scheduler on CPU, in EngineCore's order under async scheduling (issue 59, must show 3).

EngineCore's ``step_with_batch_queue`` (async scheduling: a batch queue of two) schedules step n+1 before it
processes step n's output. When step n's output finishes a request A (its last token), step n+1 is already in flight
and writes A's next position into A's last block. Releases before PR #45357 (0.19-0.23) free A's blocks at once in
``update_from_output``; the next ``schedule()`` may hand them to a request B that loads its KV from P (a KV consumer
under P/D). B's NIXL read lands by RDMA, unordered against the compute stream, and step n+1's write of A's KV can land
after it: B decodes on a block that holds A's KV (GSM8K 0.11-0.48 against 0.85 in vLLM #37285). 0.24+ defers the
return of A's blocks to the pool until the newest step in flight when A was freed has had its output processed
(``deferred_frees``, the fence): B cannot get them while step n+1 is in flight.

What is real: D's ``AsyncScheduler`` with the NIXL connector's scheduler side (``pd_harness``), its KV cache manager
and block pool (a pool of few blocks, so the next allocation takes the blocks just freed, as under load), P's
scheduler for B's prefill, and ``update_from_output`` freeing (or deferring) A's blocks. What is simulated: the
engine core's loop order (schedule, then process the oldest output, as ``step_with_batch_queue`` does) and the
sampled tokens. The GPU write itself does not run here.

The oracle is vLLM's own objects, never the KV model: the in-flight step's ``SchedulerOutput`` (A scheduled in it)
and A's block ids when that step was scheduled (``kv_cache_manager.get_block_ids``), B's block ids when it was
allocated, and which steps' outputs had been processed by then: the blocks B got that the unprocessed step writes
for A.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .kv_load_sim import run_events
from .pd_harness import PDConfig, make_pair, recording
from .pd_steps import _make_request, _mro, engine_order, p_prefill


@dataclasses.dataclass
class Reown:
    events: list[dict]
    a_req: str  # the request that finished while its next step was in flight
    b_req: str  # the request that loads its KV from P
    in_flight_step: int  # the step scheduled before A's finish was processed (writes A's blocks)
    b_step: int  # the step whose schedule() allocated B's blocks
    reowned: list[int]  # oracle: B's blocks where the unprocessed step writes A's KV at offsets B loads from P
    written: dict  # oracle: step -> the (block, offset) its forward writes for A (vLLM's own lists and counts)
    vllm: str


STOP = 9999  # the token A's third output samples: a stop token (EOS), which no scheduler sees coming


def _stopping_request(rid: str, prompt: list[int], block_size: int) -> Any:
    """``pd_steps._make_request``'s request, but one that a sampled ``STOP`` finishes (FINISHED_STOPPED), as an EOS
    does: the async scheduler has scheduled its next step by then (a max_tokens end it sees coming)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=32, stop_token_ids=[STOP])
    sp.update_from_generation_config({}, 2)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))


def reown_in_flight(*, prompt_len: int = 40, b_prompt_len: int = 40, stop_at: int = 3, block_size: int = 16,
                    revert_fix: bool = False, tag: str = "reown") -> Reown:
    """D runs request A (prefilled on D) in the engine's order; its ``stop_at``-th output token is a stop token, so
    A finishes when that output is processed, with its next step in flight; request B (``b_prompt_len`` tokens to
    load) arrives then with P's kv_transfer_params; D runs on until B is allocated. ``revert_fix``: a LABELLED FAULT
    (on a release with PR #45357: 0.24+) that turns its deferred frees off (``defer_block_free``), as 0.19-0.23 are."""
    import vllm

    max_tokens = stop_at + 2  # (the positions A may write: its steps in flight past the stop included)
    n_a = -(-(prompt_len + max_tokens + 1) // block_size)  # A's blocks, its in-flight position included
    # the pool: vLLM's null block, A's blocks, nothing more: B's allocation takes what A frees (as under load)
    cfg = PDConfig(spec_method="", async_scheduling=True, block_size=block_size, num_blocks=n_a + 1,
                   max_model_len=n_a * block_size, max_num_seqs=4, max_num_batched_tokens=max(n_a * block_size, 64))
    pair = make_pair(cfg)
    rec, d = pair.rec, pair.d
    fault = revert_fix and hasattr(d, "defer_block_free")
    if fault:
        d.defer_block_free = False
    a_req, p_req, b_req = f"{tag}-A", f"{tag}-P", f"{tag}-B"
    rec.flush()
    start = len(rec.events or [])
    a_writes: dict[int, set[tuple[int, int]]] = {}  # step -> (block, offset) its forward writes for A
    processed: set[int] = set()
    in_flight = b_step = -1
    reowned: list[int] = []
    with recording(rec):
        rec.emit("mark", label="scenario", sim=True, detail="reown_in_flight (engine order)"
                 + (": LABELLED FAULT, PR #45357 reverted (Scheduler.defer_block_free = False)" if fault else ""))
        if fault:
            rec.emit("fault.inject", rule="pr45357-reverted", sim=True, inst="D",
                     detail="Scheduler.defer_block_free = False: a finished request's blocks return to the pool at "
                            "once, as vLLM 0.19-0.23 free them (the fix of vLLM #37285 reverted)")
        a = _stopping_request(a_req, [700 + i for i in range(prompt_len)], block_size)
        n_out = 0
        d.add_request(a)
        b_added = False
        for _i, kind, out, step, queue in engine_order(d, 4 * (max_tokens + 4)):
            if kind == "scheduled":
                if a_req in out.num_scheduled_tokens and a_req in d.requests:
                    # positions this step writes: the tokens it scheduled, below A's num_computed_tokens (which
                    # schedule() has already advanced past them); where: A's own block list (group 0)
                    n, c = out.num_scheduled_tokens[a_req], a.num_computed_tokens
                    ids = d.kv_cache_manager.get_block_ids(a_req)[0]
                    a_writes[step] = {(ids[p // block_size], p % block_size) for p in range(c - n, c)}
                if b_added and b_step < 0 and b_req in d.requests and d.kv_cache_manager.get_block_ids(b_req)[0]:
                    b_step = step
                    b_ids = d.kv_cache_manager.get_block_ids(b_req)[0]
                    n_load = len(d.requests[b_req].prompt_token_ids)  # the prompt P computed, loaded by NIXL
                    loads = {(b_ids[p // block_size], p % block_size) for p in range(n_load)}
                    pending = [s for _o, s in queue if s not in processed and s in a_writes]
                    hit = loads & set().union(*(a_writes[s] for s in pending)) if pending else set()
                    reowned = sorted({blk for blk, _off in hit})
                    break
                continue
            old = out
            toks = {}
            if a_req in old.num_scheduled_tokens and a_req in d.requests:
                n_out += 1
                toks = {a_req: [STOP if n_out == stop_at else 900 + step]}
            d.update_from_output(old, _mro(old, toks))
            processed.add(step)
            if not b_added and (a_req not in d.requests or a.is_finished()):
                if in_flight < 0 and queue:
                    in_flight = queue[-1][1]  # the step scheduled before A's finish was processed
                b_prompt = [1700 + i for i in range(b_prompt_len)]
                params = p_prefill(pair.p, p_req, b_prompt, block_size)
                d.add_request(_make_request(b_req, b_prompt, 8, dict(params), block_size))
                b_added = True
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    return Reown(run_events(pair, start), a_req, b_req, in_flight, b_step, reowned, a_writes, vllm.__version__)


def scenario(revert_fix: bool) -> Any:
    """The sample pair's builder (``scenarios.SCENARIOS``): vLLM 0.32.0 has PR #45357's deferred frees; the buggy
    sample reverts them as a LABELLED FAULT (``revert_fix``), as 0.19-0.23 are. Expected findings from vLLM's objects
    (``Reown.reowned``), never from the detector."""
    def build() -> Any:
        from pdtrace.detectors.base import KV_INVARIANT

        from .scenario_builders import Scenario

        r = reown_in_flight(b_prompt_len=40, revert_fix=revert_fix, tag="reown")
        real = ("vLLM 0.32.0 AsyncScheduler / KVCacheManager / block pool / NIXL connector scheduler side of D (a "
                "pool of A's blocks and the null block), P's scheduler for B's prefill, update_from_output freeing "
                "(or deferring) A's blocks, on CPU with pdtrace hooks")
        sim = ("the engine core's order under async scheduling (EngineCore.step_with_batch_queue: step n+1 scheduled "
               "before step n's output is processed) and the sampled tokens (A's third is a stop token); the GPU "
               "write and the NIXL read do not run")
        fault = ("pr45357-reverted: Scheduler.defer_block_free = False, A's blocks return to the pool at once, as "
                 "vLLM 0.19-0.23 free them (vLLM #37285)")
        return Scenario("", "", r.events, [KV_INVARIANT] if r.reowned else [], {
            "real": [real], "simulated": [sim], "faults": [fault] if revert_fix else [], "fixture": [],
            "own_bug": "", "clean_twin": "" if revert_fix else ("vLLM 0.32.0 as released: PR #45357 defers A's "
                                                                  "blocks until the step in flight is processed"),
            "facts": {"reowned": r.reowned, "in_flight_step": r.in_flight_step, "b_step": r.b_step},
        }, [])
    return build
