"""A block handed to a KV load while a step in flight still writes it (vLLM #37285; issue 59, must show 3).

Real parts: D's AsyncScheduler with the NIXL connector's scheduler side and P's scheduler (``pd_harness``), driven in
EngineCore's batch-queue order by ``pdtrace.testing.kv_reown_sim``; the pinned vLLM (0.32.0) carries PR #45357's
fix (deferred frees), the releases that carry the bug (0.19.1-0.23.0) run the same scenario in
tests/test_real_releases.py (family kv-reown-in-flight, in each release's venv by scripts/test.sh). The oracle is
vLLM's own objects (the in-flight step's scheduled tokens, both requests' block lists, which outputs were processed),
never the KV model; ``sched.output`` is recorded by the real hook on ``update_from_output``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdtrace.detectors import run_all  # noqa: E402
from pdtrace.detectors.base import ALL_KINDS, KV_INVARIANT  # noqa: E402
from pdtrace.testing.kv_reown_sim import reown_in_flight  # noqa: E402


@pytest.fixture(scope="module")
def fixed():
    return reown_in_flight(tag="fixed")


def test_the_hook_records_each_processed_step_in_the_engine_order(fixed):
    """sched.output names each step whose output update_from_output processed, after the next step was scheduled
    (async scheduling: a batch queue of two)."""
    d = [e for e in fixed.events if e.get("inst") == "D" and e["ev"] in ("sched.step", "sched.output")]
    order = [(e["ev"], e["step"]) for e in d]
    outs = [s for ev, s in order if ev == "sched.output"]
    assert outs and outs == sorted(outs)
    for s in outs:  # step s's output came after step s+1 was scheduled (or s was the last step with tokens)
        assert order.index(("sched.output", s)) > order.index(("sched.step", s))
    assert ("sched.output", fixed.in_flight_step) in order and \
        order.index(("sched.step", fixed.in_flight_step)) < order.index(("sched.output", fixed.in_flight_step - 1))


def test_the_fixed_scheduler_never_hands_a_block_in_flight_and_nothing_is_flagged(fixed):
    """vLLM 0.32.0 defers the return of the finished request's blocks to the pool until the step in flight is
    processed: the request that loads from P gets them only after (the oracle), and the invariant says nothing."""
    assert fixed.b_step > fixed.in_flight_step and fixed.reowned == []
    assert [f for f in run_all(fixed.events, {}) if f.kind == KV_INVARIANT] == []


def test_the_fix_reverted_the_invariant_alone_flags_exactly_what_vllms_objects_say():
    """PR #45357 reverted on the pinned vLLM (``revert_fix``: a labelled fault beside the fixed run above): B gets A's
    blocks while step n+1 is in flight, the oracle names the block where A's write lands in what B loads, and `check`
    with the six rules says nothing; the KV invariant alone flags B, naming that block and the step."""
    r = reown_in_flight(revert_fix=True, tag="nofence")
    assert any(e["ev"] == "mark" and "LABELLED FAULT" in e.get("detail", "") for e in r.events)
    assert r.reowned, "the reverted fix should hand B a block the step in flight writes (vLLM's objects)"
    rules = [k for k in ALL_KINDS if k != KV_INVARIANT]
    assert run_all(r.events, {}, only=rules) == []
    (f,) = run_all(r.events, {}, only=[KV_INVARIANT])
    assert f.req == r.b_req and f.data["mechanism"] == "in-flight-write" and f.data["block"] in r.reowned
    assert f.data["in_flight_step"] == r.in_flight_step and f.data["writer"] == r.a_req
    assert sorted({b for _g, b, _i in f.data["bad_blocks"]}) == r.reowned


def test_a_write_in_flight_outside_what_b_loads_is_not_flagged():
    """Fix reverted, but B loads 8 tokens: A's in-flight write lands past them (B's own forward writes that position
    later, on the same stream): vLLM's objects say nothing is corrupted, and the invariant agrees."""
    r = reown_in_flight(b_prompt_len=8, revert_fix=True, tag="nofence8")
    assert r.reowned == []
    assert run_all(r.events, {}, only=[KV_INVARIANT]) == []
