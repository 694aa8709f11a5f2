"""A sliding-window block pruned while a step in flight still reads it, then handed to a KV load (vLLM #47282;
issue 59, must show 3, the second mechanism).

Real parts: D's AsyncScheduler with one sliding-window KV cache group and the NIXL connector's scheduler side, and
P's scheduler (``pd_harness``), driven in EngineCore's batch-queue order by ``pdtrace.testing.kv_prune_sim``. The
pinned vLLM (0.32.0) carries PR #47728's fix (pruning by the processed count); the releases that carry the bug
(0.19.1-0.25.x) run the same scenario in tests/test_real_releases.py (family kv-prune-in-flight, in each release's
venv by scripts/test.sh). The oracle is vLLM's own objects (each step's scheduled tokens, A's block list and
num_computed_tokens when it was scheduled, B's block list when it was allocated, which outputs were processed),
never the KV model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdtrace.detectors import run_all  # noqa: E402
from pdtrace.detectors.base import ALL_KINDS, KV_INVARIANT  # noqa: E402
from pdtrace.testing.kv_prune_sim import prune_in_flight  # noqa: E402


def test_the_fixed_scheduler_never_prunes_a_block_a_step_in_flight_reads_and_nothing_is_flagged():
    """vLLM 0.32.0 prunes by the processed count: the block a step in flight still reads stays A's, so B waits for
    a free block and gets one no unprocessed step of A reads (the oracle); the invariant says nothing."""
    r = prune_in_flight(tag="fixed")
    assert r.b_step > 0 and r.reowned == []
    assert [f for f in run_all(r.events, {}) if f.kind == KV_INVARIANT] == []


def test_the_fix_reverted_the_invariant_alone_flags_exactly_the_request_whose_window_was_pruned():
    """PR #47728 reverted on the pinned vLLM (``revert_fix``: a labelled fault beside the fixed run above): the next
    schedule() prunes the block whose last position step n (in flight) reads, and B's load from P gets it. The six
    rules say nothing; the invariant alone flags A (its in-flight step reads what B's NIXL read overwrites), naming
    the block, the step and B."""
    r = prune_in_flight(revert_fix=True, tag="optimistic")
    assert any(e["ev"] == "mark" and "LABELLED FAULT" in e.get("detail", "") for e in r.events)
    assert r.reowned, "the reverted fix should hand B a block a step in flight reads (vLLM's objects)"
    rules = [k for k in ALL_KINDS if k != KV_INVARIANT]
    assert run_all(r.events, {}, only=rules) == []
    (f,) = run_all(r.events, {}, only=[KV_INVARIANT])
    assert f.req == r.a_req and f.data["mechanism"] == "in-flight-read" and f.data["loader"] == r.b_req
    assert sorted({b for _g, b, _i in f.data["bad_blocks"]}) == r.reowned
    step = f.data["in_flight_step"]
    assert any(blk in r.reowned for blk, _off in r.reads[step])  # vLLM's own lists: that step read the block


def test_a_load_that_misses_the_positions_still_read_is_not_flagged():
    """Fix reverted, but the window's pruned block is read only at its last offset, and B loads 8 tokens into it:
    the NIXL read does not reach what the step in flight reads. vLLM's objects say nothing is corrupted, and the
    invariant agrees."""
    r = prune_in_flight(b_prompt_len=8, extra=0, revert_fix=True, tag="optimistic8")
    assert r.b_step > 0 and r.handed and r.reowned == []  # B got the pruned block; its load misses what is read
    assert run_all(r.events, {}, only=[KV_INVARIANT]) == []
