"""Named, labelled scenarios: the detector corpus and the bundled sample traces.

Every scenario runs REAL vLLM 0.32.0 scheduler and NIXL-connector code on CPU with the
pdtrace hooks applied (``pd_harness``: a P and a D scheduler handing over
kv_transfer_params, the real ``_apply_prefix_caching``), plus, where the bug lives in
GPU-only code, the documented worker-side simulation (``worker_sim``: real InputBatch and
connector classes on CPU driven in the order the GPU model runner calls them, GPU-only
steps marked ``sim: true``). Faults are the labelled fixtures of ``pd_harness`` /
``worker_sim`` re-introducing the pre-fix upstream rule.

The expected findings of a scenario come from what was injected and from the real block
lists the harness returned (an oracle independent of the detectors), never from running
the detectors.

    build(name) -> Scenario(events, expected kinds, provenance)
    SCENARIOS: name -> (description, builder)
"""

from __future__ import annotations

from typing import Callable

from .crossed_sim import drafter_scenario as _drafter_group
from .crossed_sim import scenario as _crossed
from .kv_inflight_sim import scenario as _kv_inflight
from .kv_prune_sim import scenario as _kv_prune
from .kv_reown_sim import scenario as _kv_reown
from .kv_shared_sim import scenario as _kv_shared
from .scenario_builders import (  # noqa: F401 - Scenario and the fixtures' kinds are part of this module's API
    NIXL_HOOK_KINDS, SCHED_KINDS, Scenario, _attn_kinds, _dflash, _hook_failure, _kv_load, _lookahead, _metadata,
    _race, _reused_ids, _stale, _two_p_two_d, failing_recorder,
)


SCENARIOS: dict[str, tuple[str, Callable[[], Scenario]]] = {
    # seeds 000/001: lookahead blocks at block boundaries
    "lookahead_aligned16_k1_buggy": ("prompt 16 = 1 block, EAGLE k=1: P reports its 1 trailing lookahead block, D end-trims it in",
                                     _lookahead(16, 1, True)),
    "lookahead_aligned16_k1_fixed": ("prompt 16, EAGLE k=1, fixed vLLM 0.32.0: P clips to computed tokens",
                                     _lookahead(16, 1, False)),
    "lookahead_aligned32_k17_buggy": ("prompt 32, EAGLE k=17: 2 trailing lookahead blocks reported",
                                      _lookahead(32, 17, True)),
    "lookahead_aligned32_k17_fixed": ("prompt 32, EAGLE k=17, fixed", _lookahead(32, 17, False)),
    "lookahead_unaligned20_k3_buggy": ("prompt 20, EAGLE k=3: the lookahead fits in the last prompt block (0 trailing "
                                       "blocks): the old rule is harmless here", _lookahead(20, 3, True)),
    "lookahead_unaligned30_k3_buggy": ("prompt 30 (not aligned), EAGLE k=3: 33 slots spill into a 3rd block",
                                       _lookahead(30, 3, True)),
    "lookahead_unaligned30_k3_fixed": ("prompt 30, EAGLE k=3, fixed", _lookahead(30, 3, False)),
    "lookahead_hybrid_mamba_buggy": ("hybrid attention + Mamba state group, prompt 16, k=3: attention group shifted, "
                                     "state group untouched", _lookahead(16, 3, True, hybrid=True)),
    "lookahead_hybrid_mamba_fixed": ("hybrid attention + Mamba, prompt 16, k=3, fixed", _lookahead(16, 3, False, hybrid=True)),
    # issue 19 point 7: xPyD, and attention kinds other than full attention
    "two_p_two_d_buggy": ("2P2D: each of two prefill engines sends a block-aligned request (prompt 32, EAGLE k=1) "
                          "to each of two decode engines; only P2 runs the pre-fix rule", _two_p_two_d(True)),
    "two_p_two_d_fixed": ("2P2D, the same four transfers on fixed vLLM", _two_p_two_d(False)),
    "sliding_window_only_buggy": ("sliding-window-only model (window 32, block 16), prompt 80, EAGLE k=3: P's old rule "
                                  "reports its lookahead block after the in-window tail", _attn_kinds(("sliding",), True)),
    "sliding_window_only_fixed": ("sliding-window-only model, prompt 80, EAGLE k=3, fixed: P reports the in-window "
                                  "tail (null blocks before it)", _attn_kinds(("sliding",), False)),
    "sliding_plus_full_buggy": ("full-attention + sliding-window groups, prompt 80, EAGLE k=3: both groups shifted",
                                _attn_kinds(("full", "sliding"), True)),
    "sliding_plus_full_fixed": ("full-attention + sliding-window groups, prompt 80, EAGLE k=3, fixed",
                                _attn_kinds(("full", "sliding"), False)),
    "chunked_local_ngram_fixed": ("chunked local attention (chunks of 32), prompt 80, ngram (vLLM refuses EAGLE with "
                                  "chunked local attention): no lookahead, the class does not apply",
                                  _attn_kinds(("chunked",), False, spec="ngram")),
    # seed 002
    "metadata_cleared_before_drafter_buggy": ("EAGLE on P: connector metadata cleared before the drafter layers",
                                              _metadata(True)),
    "metadata_cleared_before_drafter_fixed": ("EAGLE on P: clear deferred until after the drafter (vLLM PR #34529)",
                                              _metadata(False)),
    # seed 003
    "dflash_window_buggy": ("DFlash k=3, prompt 29: k lookahead slots instead of k+1, the drafter writes past the "
                            "request's blocks", _dflash(True)),
    "dflash_window_fixed": ("DFlash k=3, prompt 29, fixed: k+1 lookahead slots", _dflash(False)),
    # seed 004
    "stale_read_rowmoves_buggy": ("async spec decode on D, rows swapped/condensed between copy and read, racy read",
                                  _stale(True, True)),
    "stale_read_rowmoves_fixed": ("async spec decode on D with row moves, synchronized read", _stale(False, True)),
    "stale_read_norowmoves_buggy": ("async spec decode on D, no row moves, read before the copy completed",
                                    _stale(True, False)),
    "stale_read_norowmoves_fixed": ("async spec decode on D, no row moves, synchronized read", _stale(False, False)),
    # issue 19 point 4: rows added past the last copy's rows hold add_request's value, not a stale one
    "stale_read_batch_growth_buggy": ("async spec decode on D, row moves, two requests added at step 4 in rows past "
                                      "the last copy's rows, racy read: only the covered rows are stale",
                                      _stale(True, True, grow=True)),
    "stale_read_batch_growth_fixed": ("the same batch growth on the synchronized path (vLLM 0.32.0): the fresh rows "
                                      "are not stale reads", _stale(False, True, grow=True)),
    # vLLM #51571, open upstream (0.23-0.33 align mode): where the copy lands decides the read
    "race_51571_lands_before_moves_buggy": ("hybrid align mode, async: the accepted-count copy lands before the "
                                            "reorder swaps a decode with a new request; the decode reads the new "
                                            "request's 1 through its previous row", _race("before", False)),
    "race_51571_lands_after_moves_fixed": ("the same step when the copy lands after the row moves (at the "
                                           "synchronize): every read is its own count", _race("after", False)),
    "race_51571_snapshot_fixed": ("the same step with vLLM PR #51599's approach (labelled): the copy lands in a "
                                  "runner-owned snapshot; the read is right", _race("before", True)),
    # issue 36: a KV load that fails on D, and the recovery
    "kv_load_nixl_read_fail_fixed": ("D's NIXL read fails (finished_recving + failed_recving + invalid_block_ids, as "
                                     "vLLM 0.32.0's worker reports it), policy 'fail': the request is failed and "
                                     "finishes FINISHED_ERROR", _kv_load("fail")),
    "kv_load_nixl_read_recompute_fixed": ("D's NIXL read fails, policy 'recompute': the request is retried from token "
                                          "0 and runs to its end", _kv_load("recompute")),
    "kv_load_sync_rollback_fixed": ("block index 2 of a running request reported failed (a synchronous load, as vLLM's "
                                    "own tests report it), policy 'recompute', synchronous scheduler: cut back to 32 "
                                    "tokens, exactly what is left is recomputed", _kv_load("recompute", when="running",
                                                                                          how="blocks", failed=(2,))),
    "kv_load_async_rollback_buggy": ("block index 2 of a running request reported failed, policy 'recompute', on vLLM "
                                     "0.32.0's own AsyncScheduler, no planted fault: the placeholders are not rolled "
                                     "back (vLLM #49250 / #45138), the recompute is scheduled one token past the "
                                     "request, which then stalls", _kv_load("recompute", when="running",
                                                                                    how="blocks", failed=(2,),
                                                                                    async_scheduling=True)),
    "kv_load_async_rollback_fixed": ("block index 2 of a running request reported failed, policy 'recompute', "
                                     "AsyncScheduler with the placeholders reset on rollback (the approach of vLLM PRs "
                                     "#45430 / #49252, labelled): exactly what is left is recomputed", _kv_load(
                                         "recompute", when="running", how="blocks", failed=(2,), async_scheduling=True,
                                         fix=True)),
    # issue 50: a failed block two requests share, read before its rewrite under chunked prefill
    "kv_load_shared_block_buggy": ("blocks 1-3 of a running request, shared with a second request through D's "
                                   "prefix cache, reported failed, policy 'recompute', chunked prefill "
                                   "(long_prefill_token_threshold=16), on vLLM 0.32.0's own Scheduler, no planted "
                                   "fault: the second request keeps them as computed and decodes on them before the "
                                   "first rewrites them", _kv_shared(16)),
    "kv_load_shared_block_fixed": ("the same shared failed blocks without long_prefill_token_threshold (vLLM's "
                                   "default; the clean twin, not a fix): the first request recomputes them in one "
                                   "step, written before that step's attention reads them", _kv_shared(0)),
    # issue 51: KV that never crossed: the hand-over to D drops P's kv_transfer_params
    "kv_never_crossed_dropped_params_buggy": ("6 prompts P prefilled for a remote decode on vLLM 0.32.0's own "
                                              "schedulers; the hand-over to D leaves the params of 2 out (FAULT: the "
                                              "router's, smg PR #1622's shape): D prefills those again; 1 more "
                                              "request sent to D alone", _crossed((1, 4))),
    "kv_never_crossed_dropped_params_fixed": ("the same prompts, every one handed to D with P's params: D loads "
                                              "them all; the request sent to D alone is no fault", _crossed(())),
    # issue 51: the drafter's own KV cache group left out of the transfer (vLLM #54926's shape)
    "kv_never_crossed_drafter_group_buggy": ("EAGLE with the drafter's layer in a KV cache group of its own, left "
                                             "out of the transfer groups on P and D (FAULT: enable_kv_transfer=False,"
                                             " vLLM #54926's shape): D loads 3 prompts into the target's group "
                                             "only and counts them computed", _drafter_group("kept")),
    "kv_never_crossed_drafter_group_fixed": ("the same with vLLM's default, every group transfers: the connector "
                                             "loads the drafter's group too", _drafter_group("transfer")),
    # issue 50 / 61: the token of the step in flight at a KV-load rollback, appended after it (open upstream)
    "kv_load_in_flight_token_buggy": ("block index 2 of a running request reported failed, policy 'recompute', on "
                                      "vLLM 0.32.0's own AsyncScheduler in the engine core's order, no planted "
                                      "fault: the step in flight at the rollback ran on the failed KV and its token "
                                      "is appended to the output after the rollback; the same rollback keeps the "
                                      "output placeholders (the rollback sample's bug): two causes, both vLLM's own",
                                      _kv_inflight(False)),
    "kv_load_in_flight_token_fixed": ("the same with a labelled fix: the rollback drops the in-flight output and "
                                      "resets the placeholders: exactly what is left is recomputed, no token of the "
                                      "failed KV reaches the output", _kv_inflight(True)),
    # issue 59 / 61: a KV load into blocks a step in flight still writes (vLLM #37285, fixed by PR #45357 in 0.24)
    "kv_reown_in_flight_buggy": ("request A stops (a stop token) while its next step is in flight under async "
                                 "scheduling; its blocks return to the pool at once (FAULT: PR #45357 reverted, as "
                                 "0.19-0.23 free them) and request B, loading 40 prompt tokens from P, gets them: "
                                 "the in-flight step writes A's KV where B's NIXL read lands", _kv_reown(True)),
    "kv_reown_in_flight_fixed": ("the same on vLLM 0.32.0 as released: A's blocks are deferred until the step in "
                                 "flight is processed; B gets none of them while it is", _kv_reown(False)),
    # issue 59 / 61: a sliding-window block pruned while a step in flight reads it, handed to a KV load (vLLM #47282,
    # fixed by PR #47728 in 0.26)
    "kv_prune_in_flight_buggy": ("request A decodes with a 32-token sliding window under async scheduling; the next "
                                 "schedule() prunes a block its step in flight still reads (FAULT: PR #47728 "
                                 "reverted, as 0.19-0.25 prune by the optimistic count) and request B, loading 32 "
                                 "prompt tokens from P, gets it", _kv_prune(True)),
    "kv_prune_in_flight_fixed": ("the same on vLLM 0.32.0 as released: the window is pruned by the processed count; "
                                 "B gets no block a step in flight reads", _kv_prune(False)),
    # issue 19: two schedulers per role in one process reusing request ids
    "reused_ids_two_pairs_buggy": ("two P/D pairs in one process (block 16 and 32), both with request id "
                                   "'id-1'; pair 1 under the pre-fix P rule", _reused_ids(True)),
    "reused_ids_two_pairs_fixed": ("two P/D pairs in one process reusing request id 'id-1', fixed vLLM",
                                   _reused_ids(False)),
    # issue 19: hooks that raise -> the classes they feed are "not checked", never clean
    "hook_failure_scheduler_fixed": ("every scheduler hook raises (no sched.* / req.* events), fixed vLLM: "
                                     "lookahead class not checked", _hook_failure(SCHED_KINDS, False)),
    "hook_failure_nixl_buggy": ("the NIXL connector hooks raise while P reports its lookahead block (pre-fix "
                                "rule): no transfer recorded, the class is not checked, not clean",
                                _hook_failure(NIXL_HOOK_KINDS, True)),
}

# The bundled sample traces (sample_traces/): one buggy and one fixed per seed bug class, and per the
# KV-load-failure class (issue 36).
SAMPLES = (
    "lookahead_aligned16_k1_buggy", "lookahead_aligned16_k1_fixed",
    "metadata_cleared_before_drafter_buggy", "metadata_cleared_before_drafter_fixed",
    "dflash_window_buggy", "dflash_window_fixed",
    "stale_read_rowmoves_buggy", "stale_read_rowmoves_fixed",
    "kv_load_async_rollback_buggy", "kv_load_async_rollback_fixed",
    "kv_load_shared_block_buggy", "kv_load_shared_block_fixed",
    "kv_never_crossed_dropped_params_buggy", "kv_never_crossed_dropped_params_fixed",
    "kv_never_crossed_drafter_group_buggy", "kv_never_crossed_drafter_group_fixed",
    "kv_load_in_flight_token_buggy", "kv_load_in_flight_token_fixed",
    "kv_reown_in_flight_buggy", "kv_reown_in_flight_fixed",
    "kv_prune_in_flight_buggy", "kv_prune_in_flight_fixed",
)
DEMO_SAMPLE = "lookahead_aligned16_k1_buggy"


def build(name: str) -> Scenario:
    desc, fn = SCENARIOS[name]
    sc = fn()
    sc.name, sc.description = name, desc
    sc.expected = sorted(set(sc.expected))
    sc.not_checked = sorted(set(sc.not_checked))
    return sc
