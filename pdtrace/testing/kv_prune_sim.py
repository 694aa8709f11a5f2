"""A sliding-window block pruned while a step in flight still reads it, then handed to a KV load (vLLM #47282,
fixed by PR #47728), through vLLM's real scheduler on CPU, in EngineCore's order under async scheduling (issue 59,
must show 3, the second mechanism).

Under async scheduling ``schedule()`` advances a request's ``num_computed_tokens`` past the tokens it just
scheduled, before that step has run. The next ``schedule()`` (step n+1, with step n in flight) frees the blocks
outside the sliding window (``remove_skipped_blocks``) by that optimistic count: the block holding the first
position step n's window reads (``num_computed_tokens - W + 1``) leaves the request while step n still attends to
it. Once back in the pool, a request that loads its KV from P (a KV consumer under P/D) may be handed it; its NIXL
read lands by RDMA, unordered against step n's attention, which then reads another prompt's KV (vllm-ascend #13501:
DeepSeek-V4 on v0.23.0, sliding window 128, block 32; GPQA 85-89 against 89+). vLLM 0.26.0 (PR #47728) frees on
the processed-token basis (``num_computed_tokens - request.num_in_flight_tokens``); 0.19-0.25 use the optimistic
count.

What is real: D's ``AsyncScheduler`` with one sliding-window KV cache group and the NIXL connector's scheduler side
(``pd_harness``), its KV cache manager and block pool (a pool of few blocks, so the next allocation takes the block
just pruned, as under load), P's scheduler for B's prefill. What is simulated: the engine core's loop order
(``pd_steps.engine_order``) and the sampled tokens. No attention kernel runs here.

The oracle is vLLM's own objects, never the KV model: the in-flight step's ``SchedulerOutput`` (A scheduled in it)
and A's block ids when it was scheduled (``kv_cache_manager.get_block_ids``) with A's ``num_computed_tokens`` give
the blocks its window reads; B's block ids when it was allocated, and which steps' outputs had been processed by
then: the blocks B got that an unprocessed step of A reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .kv_load_sim import run_events
from .pd_harness import PDConfig, make_pair, recording
from .pd_steps import _make_request, _mro, engine_order, p_prefill


@dataclasses.dataclass
class Prune:
    events: list[dict]
    a_req: str  # the decoding request whose window moves
    b_req: str  # the request that loads its KV from P
    b_step: int  # the step whose schedule() allocated B's blocks
    reowned: list[int]  # oracle: B's blocks where the load lands at offsets an unprocessed step of A still reads
    handed: list[int]  # ... B's blocks to load that an unprocessed step of A reads, at whatever offsets
    reads: dict  # oracle: step -> the (block, offset) its window reads for A (vLLM's own lists and counts)
    vllm: str


def prune_in_flight(*, prompt_len: int = 40, window: int = 32, block_size: int = 16, b_prompt_len: int = 32,
                    extra: int = 1, revert_fix: bool = False, tag: str = "prune") -> Prune:
    """D decodes request A (prefilled on D) in the engine's order with a sliding window of ``window`` tokens; when
    a step's ``schedule()`` prunes a block an unprocessed step of A still reads, request B (``b_prompt_len`` tokens
    to load) arrives with P's kv_transfer_params, so the same ``schedule()`` hands it the free blocks; D runs on
    until B is allocated. ``revert_fix``: a LABELLED FAULT (on a release with PR #47728: 0.26+) that prunes by the
    optimistic count, as 0.19-0.25 do (the KV cache coordinator's ``remove_skipped_blocks`` of this scheduler
    given the processed count plus ``request.num_in_flight_tokens``)."""
    import vllm

    steps = 4 * block_size
    n_a = -(-(prompt_len + steps + 2) // block_size)  # A's blocks over its decode, were none pruned
    n_a_win = -(-window // block_size) + 1  # ... what A holds at once: its window and its next position
    cfg = PDConfig(spec_method="", async_scheduling=True, block_size=block_size, attn=("sliding",), window=window,
                   num_blocks=n_a_win + 1 + extra, max_model_len=n_a * block_size + 64,
                   max_num_seqs=4, max_num_batched_tokens=max(n_a * block_size, 128))
    pair = make_pair(cfg)
    rec, d = pair.rec, pair.d
    a_req, p_req, b_req = f"{tag}-A", f"{tag}-P", f"{tag}-B"
    coord = d.kv_cache_manager.coordinator
    fault = revert_fix and hasattr(_make_request("probe", [1], 1, None, block_size), "num_in_flight_tokens")
    if fault:  # the pruning count as 0.19-0.25 pass it: the processed count plus the tokens still in flight
        prune = coord.remove_skipped_blocks

        def optimistic(request_id: str, processed: int, *a: Any, **kw: Any) -> Any:
            r = d.requests.get(request_id)
            return prune(request_id, processed + (r.num_in_flight_tokens if r is not None else 0), *a, **kw)

        coord.remove_skipped_blocks = optimistic
    rec.flush()
    start = len(rec.events or [])
    a_reads: dict[int, set[tuple[int, int]]] = {}  # step -> the (block, offset) its window reads for A
    processed: set[int] = set()
    b_step = -1
    reowned: list[int] = []
    handed: list[int] = []
    with recording(rec):
        a = _make_request(a_req, [700 + i for i in range(prompt_len)], steps, None, block_size)
        rec.emit("mark", label="scenario", sim=True, detail="prune_in_flight (engine order)"
                 + (": LABELLED FAULT, PR #47728 reverted (pruning by the optimistic count)" if fault else ""))
        if fault:
            rec.emit("fault.inject", rule="pr47728-reverted", sim=True, inst="D",
                     detail="the sliding window pruned by the optimistic count (the processed count plus the tokens "
                            "in flight), as vLLM 0.19-0.25 prune (the fix of vLLM #47282 reverted)")
        d.add_request(a)
        b_added = False
        for _i, kind, out, step, queue in engine_order(d, 6 * steps):
            if kind == "scheduled":
                if a_req in out.num_scheduled_tokens and a_req in d.requests:
                    n, c = out.num_scheduled_tokens[a_req], a.num_computed_tokens
                    ids = d.kv_cache_manager.get_block_ids(a_req)[0]
                    first = max(c - n - window + 1, 0)  # the window of its first query position (vLLM's rule)
                    a_reads[step] = {(ids[p // block_size], p % block_size) for p in range(first, c)
                                     if p // block_size < len(ids) and ids[p // block_size]}
                if b_added and b_step < 0 and b_req in d.requests and d.kv_cache_manager.get_block_ids(b_req)[0]:
                    b_step = step
                    b_ids = d.kv_cache_manager.get_block_ids(b_req)[0]
                    n_load = len(d.requests[b_req].prompt_token_ids)  # the prompt P computed, loaded by NIXL
                    loads = {(b_ids[p // block_size], p % block_size) for p in range(n_load)
                             if p // block_size < len(b_ids) and b_ids[p // block_size]}
                    pending = [s for _o, s in queue if s not in processed and s in a_reads and s != step]
                    hit = loads & set().union(*(a_reads[s] for s in pending)) if pending else set()
                    reowned = sorted({blk for blk, _off in hit})
                    read = {blk for st in pending for blk, _off in a_reads[st]}
                    handed = sorted(read & {blk for blk, _off in loads})
                    break
                if not b_added and a_req in d.requests and a.num_computed_tokens > prompt_len + block_size \
                        and (a.num_computed_tokens - window + 1) % block_size == 0:
                    # the next schedule() prunes a block this step (in flight then) still reads: B arrives now
                    b_prompt = [1700 + i for i in range(b_prompt_len)]
                    params = p_prefill(pair.p, p_req, b_prompt, block_size)
                    d.add_request(_make_request(b_req, b_prompt, 8, dict(params), block_size))
                    b_added = True
                continue
            toks = {a_req: [900 + step]} if a_req in out.num_scheduled_tokens and a_req in d.requests else {}
            d.update_from_output(out, _mro(out, toks))
            processed.add(step)
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    return Prune(run_events(pair, start), a_req, b_req, b_step, reowned, handed, a_reads, vllm.__version__)


def scenario(revert_fix: bool) -> Any:
    """The sample pair's builder (``scenarios.SCENARIOS``): vLLM 0.32.0 prunes by the processed count (PR #47728);
    the buggy sample reverts it as a LABELLED FAULT (``revert_fix``), as 0.19-0.25 prune. Expected findings from
    vLLM's objects (``Prune.reowned``), never from the detector."""
    def build() -> Any:
        from pdtrace.detectors.base import KV_INVARIANT

        from .scenario_builders import Scenario

        r = prune_in_flight(revert_fix=revert_fix, tag="prune")
        real = ("vLLM 0.32.0 AsyncScheduler / KVCacheManager with one sliding-window group (32 tokens) / block pool / "
                "NIXL connector scheduler side of D (a pool of a window's blocks and one more), P's scheduler for B's "
                "prefill, on CPU with pdtrace hooks")
        sim = ("the engine core's order under async scheduling (EngineCore.step_with_batch_queue: step n+1 scheduled "
               "before step n's output is processed) and the sampled tokens; no attention kernel and no NIXL read run")
        fault = ("pr47728-reverted: the sliding window pruned by the optimistic count, as vLLM 0.19-0.25 prune "
                 "(vLLM #47282)")
        return Scenario("", "", r.events, [KV_INVARIANT] if r.reowned else [], {
            "real": [real], "simulated": [sim], "faults": [fault] if revert_fix else [], "fixture": [],
            "own_bug": "", "clean_twin": "" if revert_fix else ("vLLM 0.32.0 as released: PR #47728 prunes by the "
                                                                  "processed count"),
            "facts": {"reowned": r.reowned, "handed": r.handed, "b_step": r.b_step},
        }, [])
    return build
