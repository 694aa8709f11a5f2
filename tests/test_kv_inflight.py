"""Issue 50 item 2: the token sampled by a step in flight at a KV-load rollback, appended after it.

Real parts: D's AsyncScheduler (the installed release: 0.32.0, or 0.33.0 in CI's second suite)
with the NIXL connector's scheduler side, its failure path (_handle_invalid_blocks ->
_update_requests_with_invalid_blocks, policy recompute) and its output processing
(update_from_output -> _update_request_with_output). Simulated: the engine core's loop order
(step_with_batch_queue: schedule step n+1, then process step n's output), the report of the failed
blocks, the sampled tokens (pdtrace.testing.kv_inflight_sim). The oracle is vLLM's own request
object: whether the token the in-flight step sampled is in its output_token_ids.
"""

from __future__ import annotations

import pytest

from pdtrace.detectors import KV_LOAD_FAILURE_RECOVERY
from pdtrace.detectors.causes import group, mechanism
from pdtrace.detectors.kv_load import detect

pytest.importorskip("vllm")

IN_FLIGHT = "kv-load/in-flight-token"


def _run(**kw):
    from pdtrace.testing.kv_inflight_sim import in_flight_rollback

    r = in_flight_rollback(**kw)
    found = [f for f in detect(r.events) if f.kind == KV_LOAD_FAILURE_RECOVERY]
    return r, found, [f for f in found if mechanism(f)[0] == IN_FLIGHT]


def test_the_in_flight_token_is_flagged_where_the_release_appends_it():
    r, found, inflight = _run()
    assert r.appended, "oracle: vLLM no longer appends the in-flight step's token after a rollback"
    assert r.in_flight_step == r.rollback_step  # the batch queue of two: the latest step scheduled
    (f,) = inflight
    pos = r.output.index(r.in_flight_token)  # where vLLM's own request holds it
    assert (f.req, f.step, f.severity, f.data["position"]) == (r.d_req, r.in_flight_step, "error", pos)
    assert f.data["rollback_step"] == r.rollback_step and "None" not in f.title + f.explanation
    assert "in flight" in f.title and "update_from_output" in f.explanation
    # the over-scheduling of the same rollback (#49250) is its own cause, not folded into this one
    assert {c.mechanism for c in group(found)} == {IN_FLIGHT, "kv-load/placeholders"}


def test_a_release_that_drops_the_in_flight_output_gives_no_finding():
    """The LABELLED fixture (vLLM 0.32+'s drop_stale_output applied at the rollback; no release does
    it): vLLM's request does not hold the token, the hook records the in-flight output as appended 0,
    and pdtrace says nothing about it (the placeholders finding of the same run stays)."""
    r, found, inflight = _run(fix=True)
    assert not r.appended and r.in_flight_token not in r.output
    outs = [e for e in r.events if e["ev"] == "kvload.output"]
    dropped = [e for e in outs if e["in_flight"]]
    assert dropped and all(e["appended"] == 0 for e in dropped)
    assert any(e["step"] == r.in_flight_step for e in dropped)
    assert inflight == []


def test_outputs_are_followed_only_after_a_rollback_and_stop_after_it():
    """No kvload.output on a healthy run (the wrapper skips update_from_output); after a rollback,
    only the request's outputs up to the first step scheduled after it."""
    from pdtrace.testing.pd_harness import PDConfig, make_pair, recording
    from pdtrace.testing.pd_steps import drive, _make_request

    pair = make_pair(PDConfig(spec_method="", async_scheduling=True))
    with recording(pair.rec):
        pair.d.add_request(_make_request("healthy-D", list(range(100, 140)), 4, None, 16))
        drive(pair.d)
    pair.rec.flush()
    assert [e for e in pair.rec.events if e["ev"] == "kvload.output"] == []
    r, _found, _inflight = _run()
    outs = [e for e in r.events if e["ev"] == "kvload.output"]
    assert [e["in_flight"] for e in outs][-1] is False  # the last one followed: after the rollback
    assert all(e["step"] <= r.rollback_step for e in outs[:-1])
