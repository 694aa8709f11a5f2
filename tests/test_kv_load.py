"""KV that failed to load, and the recovery (issue 36), on real vLLM code: P's and D's real
``Scheduler`` / ``AsyncScheduler`` with the NIXL connector's scheduler side, the scheduler's
whole failure path (``_handle_failed_recving``, ``_handle_invalid_blocks``,
``_update_requests_with_invalid_blocks``), and D's NIXL worker's own ``_log_failure`` and
``get_block_ids_with_load_errors`` (``pdtrace.testing.kv_load_sim``; the failed read itself is
simulated as vLLM 0.32.0's worker reports it). The oracle is vLLM's state read from its own
objects (D's block list, num_computed_tokens after the failure, the tokens it scheduled next,
how the request finished), never the detector."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parent.parent

from pdtrace.detectors import kv_load, run_all  # noqa: E402
from pdtrace.detectors.base import KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR  # noqa: E402
from pdtrace.detectors.coverage import CHECKED, coverage  # noqa: E402
from pdtrace.testing.kv_load_sim import _has_failed_recving, failed_load  # noqa: E402
from pdtrace.testing.pd_harness import PDConfig  # noqa: E402

pytestmark = pytest.mark.vllm
NOSPEC = PDConfig(spec_method="")


def _found(r):
    return [f for f in run_all(r.events) if f.kind == KV_LOAD_FAILURE_RECOVERY]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("how", ["blocks", "both"])
def test_a_failed_nixl_read_is_recorded_with_the_schedulers_decision(policy, how):
    r = failed_load(NOSPEC, policy=policy, how=how, steps=8)
    (err,) = r.of("kvload.error")
    assert err["req"] == r.d_req and err["failure"] == "transfer_failed" and "NIXL_ERR" in err["error"]
    (rep,) = r.of("kvload.reported")
    assert rep["block_ids"] == sorted(r.d_local)  # what the worker queued: D's own blocks
    handled = r.of("kvload.handled")
    sources = [h["source"] for h in handled]
    assert sources == (["failed_recving", "invalid_blocks"] if r.how == "both" else ["invalid_blocks"])
    assert all(h["policy"] == policy and h["groups"] == 1 for h in handled)
    reqs = r.of("kvload.request")
    assert reqs and all(e["req"] == r.d_req and e["status"] == "WAITING_FOR_REMOTE_KVS" for e in reqs)
    assert [e["block_ids"][0] for e in reqs] == [r.d_local] * len(reqs)
    if policy == "fail":
        assert r.finished == "FINISHED_ERROR"  # vLLM failed it
        assert all(e["action"] == "fail" for e in reqs) and handled[-1]["failed"] == [r.d_req]
    else:
        assert reqs[-1]["computed"] == r.computed_after == 0 and reqs[-1]["retry"]
        assert r.scheduled_after[0] == r.prompt_len  # the whole prompt recomputed on D
        assert r.finished == "FINISHED_LENGTH_CAPPED"
    assert _found(r) == []  # vLLM 0.32's NIXL path recovers as it should


def test_a_partly_failed_load_restarts_at_the_first_failed_block():
    """Block index 2 of 4 fails (block size 16): vLLM cuts the request back to 32 tokens."""
    r = failed_load(NOSPEC, policy="recompute", how="blocks", failed=(2,), steps=8)
    (req,) = r.of("kvload.request")
    assert r.computed_after == req["computed"] == 2 * 16
    assert r.scheduled_after[0] == r.prompt_len - 32
    assert _found(r) == []


def test_a_recompute_that_keeps_a_failed_block_is_flagged():
    """The detector's restart rule, on the recorded events of a real run edited the way a
    scheduler that ignored the failed block would have left them (computed not cut back)."""
    r = failed_load(NOSPEC, policy="recompute", how="blocks", failed=(2,), steps=8)
    events = [dict(e) for e in r.events]
    for e in events:
        if e["ev"] == "kvload.request":
            e["computed"] = e["computed_before"]
    (f,) = [f for f in kv_load.detect(events) if "did not restart" in f.title]
    assert f.req == r.d_req and f.data["block"] == r.d_local[2] and f.data["restart_at"] == 32


@pytest.mark.parametrize("spec", ["", "eagle"])
@pytest.mark.parametrize("failed", [None, (2,)])
def test_async_scheduling_schedules_past_the_request_after_a_rollback(spec, failed):
    """vLLM #49250 (part 2) / #45138, open in 0.32.0 and 0.33.0: under async scheduling the
    placeholders are not rolled back with num_computed_tokens, so the recompute is scheduled
    num_tokens + placeholders - computed tokens. No planted fault: vLLM's own AsyncScheduler."""
    cfg = PDConfig(spec_method=spec, async_scheduling=True)
    r = failed_load(cfg, policy="recompute", how="blocks", when="running", failed=failed, max_tokens=8, steps=8)
    (req,) = r.of("kvload.request")
    assert req["status"] == "RUNNING" and req["placeholders"] > 0 and req["placeholders"] == req["placeholders_before"]
    left = req["num_tokens"] - r.computed_after
    k = cfg.num_spec_tokens if spec else 0
    assert r.scheduled_after[0] - k == left + req["placeholders"]  # vLLM's own count: past the request
    found = _found(r)
    (f,) = [f for f in found if "more than the" in f.title]
    assert f.severity == SEVERITY_ERROR and f.req == r.d_req
    assert f.data["scheduled"] - f.data["left"] == req["placeholders"]
    # #45138: the request then stops being scheduled and never finishes (vLLM's own state says so)
    stalled = [g for g in found if "stalled" in g.title]
    assert bool(stalled) == (r.finished is None and r.scheduled_after[-2:] == [0, 0])
    assert len(found) == 1 + len(stalled)


@pytest.mark.parametrize("spec", ["", "eagle"])
def test_the_labelled_placeholder_rollback_runs_the_same_step_clean(spec):
    """vLLM PRs #45430 / #49252's approach (not merged in 0.32.0 / 0.33.0), as a labelled fixture:
    placeholders reset with the rollback; the recompute is scheduled exactly what is left."""
    cfg = PDConfig(spec_method=spec, async_scheduling=True)
    r = failed_load(cfg, policy="recompute", how="blocks", when="running", failed=(2,), max_tokens=8, steps=10,
                    fix_placeholders=True)
    (req,) = r.of("kvload.request")
    k = cfg.num_spec_tokens if spec else 0
    assert req["placeholders"] == 0 and r.scheduled_after[0] - k == req["num_tokens"] - r.computed_after
    assert r.finished == "FINISHED_LENGTH_CAPPED" and _found(r) == []
    assert any(e["ev"] == "mark" and e.get("label") == "fixture" for e in r.events)


@pytest.mark.parametrize("failed", [None, (2,)])
def test_the_synchronous_scheduler_recomputes_exactly_what_is_left(failed):
    r = failed_load(NOSPEC, policy="recompute", how="blocks", when="running", failed=failed, max_tokens=8, steps=8)
    (req,) = r.of("kvload.request")
    assert req["placeholders"] == 0 and r.scheduled_after[0] == req["num_tokens"] - r.computed_after
    assert _found(r) == []


def test_a_failed_request_that_never_finishes_and_a_rollback_that_never_runs_are_flagged():
    r = failed_load(NOSPEC, policy="fail", how="blocks", steps=4)
    cut = [e for e in r.events if not (e["ev"] == "req.finish" and e.get("req") == r.d_req)]
    (f,) = kv_load.detect(cut)
    assert f.severity == SEVERITY_ERROR and "never finished" in f.title
    r2 = failed_load(NOSPEC, policy="recompute", how="blocks", steps=4)
    (i,) = [i for i, e in enumerate(r2.events) if e["ev"] == "kvload.request"]
    assert kv_load.detect(r2.events[:i + 1]) == []  # its scheduler never stepped again: cannot tell
    # its scheduler stepped on without it (the request left out of every later step's tokens)
    later = [dict(e, tokens={k: v for k, v in e["tokens"].items() if k != r2.d_req}) if e["ev"] == "sched.step"
             else e for e in r2.events[i + 1:] if not (e["ev"] == "req.finish" and e.get("req") == r2.d_req)]
    (g,) = kv_load.detect(r2.events[:i + 1] + later)
    assert "never ran again" in g.title and g.data["steps_without_it"] >= 1


def test_coverage_checks_the_class_where_d_loads_and_the_hooks_were_applied():
    r = failed_load(NOSPEC, policy="recompute", how="blocks", steps=4)
    assert coverage(r.events)[KV_LOAD_FAILURE_RECOVERY].status == CHECKED
    without = [dict(e) for e in r.events]
    for e in without:
        if e["ev"] == "hooks.status":
            e["applied"] = [h for h in e["applied"] if not h.startswith("kv_load.")]
    c = coverage(without)[KV_LOAD_FAILURE_RECOVERY]
    assert c.status != CHECKED and "kv_load.invalid_blocks" in c.reason


def test_failed_recving_exists_where_the_release_has_it():
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput

    assert _has_failed_recving() == ("failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)})


def _notes(r):
    st = kv_load.Stream()
    kv_load.feed_all(st, r.events)
    return st.notes()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_check_says_what_happened_to_each_request(policy):
    """Per request a failed load touched, the notes (what `pdtrace check` prints) carry vLLM's
    own decision and the request's end, read from the trace, one entry per request although
    vLLM 0.30+ handles one failed receive twice in the step (request, then blocks)."""
    r = failed_load(NOSPEC, policy=policy, how="both", steps=8)
    (n,) = _notes(r)
    assert n["req"] == r.d_req and n["policy"] == policy and n["failures"] == 1
    assert sorted(n["failed_blocks"]) == sorted(r.d_local) and n["blocks"] == len(r.d_local)
    assert n["finished"]["status"] == r.finished
    words = kv_load.describe(n)
    if policy == "fail":
        assert n["action"] == "fail" and "ran_again" not in n and "failed by the policy" in words
    else:
        assert n["action"] == "recompute" and n["computed"] == 0 and n["ran_again"] > n["step"]
        assert f"cut back from {n['computed_before']} to 0 computed tokens" in words
    assert f"finished at step {n['finished']['step']} ({r.finished}" in words


def test_check_prints_the_notes_in_every_format_and_path(tmp_path):
    """The fixed sample through `pdtrace check`: text, markdown and JSON, one process and -j 2
    (the detector in its own process), --request naming P's side of the same pair (listed)."""
    import json
    import subprocess
    import sys
    sample = "sample_traces/kv_load_async_rollback_fixed.jsonl"
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # (whole lines when piped)
    run = lambda *a: subprocess.run([sys.executable, "-m", "pdtrace", "check", sample, *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT, env=env)
    text = run().stdout
    assert "KV load failures: 1 request(s)" in text and "D load-2-D" in text and "ran again at step 5" in text
    assert "| D | `load-2-D` | step 4, policy recompute" in run("--format", "markdown").stdout
    docs = [json.loads(run("--format", "json", "-j", j).stdout) for j in ("1", "2")]
    assert docs[0]["kv_load"] == docs[1]["kv_load"] and docs[0]["kv_load"][0]["req"] == "load-2-D"
    # P's id of the same pair lists D's note (its other side: the trace's only pair)
    p_side = json.loads(run("--format", "json", "--request", "load-2-P").stdout)
    assert p_side["request_other_side"] == ["load-2-D"] and p_side["kv_load"] == docs[0]["kv_load"]


def test_a_hybrid_models_failed_blocks_as_the_release_handles_them():
    """A model with two KV cache groups (full attention + sliding window) whose load fails, reported
    as blocks (as vLLM's own tests and block-level connectors report it), on the installed
    release's real Scheduler. vLLM 0.2x raises ValueError unpacking the per-group block lists
    (#50687), 0.30/0.31 recompute the whole request (#50388), 0.32+ refuse with RuntimeError
    (#56855, by design: vLLM's own tests expect it). Oracle: what vLLM did (the exception the
    scheduler raised, or the request's computed tokens and finish); a raise ends the engine core,
    and check flags it, once, with vLLM's text: an error, or for the designed refusal a warning."""
    r = failed_load(PDConfig(spec_method="", attn=("full", "sliding")), policy="recompute", how="blocks", steps=6)
    (handled,) = r.of("kvload.handled")
    assert handled["groups"] == 2
    found = _found(r)
    if r.raised is not None and r.raised.startswith("RuntimeError"):  # 0.32+: refused by design (#56855)
        assert handled["error"] == r.raised and "multiple KV cache groups" in r.raised
        # vLLM's own tests expect this refusal, but the engine core died: a warning, on the first screen,
        # naming vLLM's message and the issue (issue 50 item 3), and the requests its last step scheduled
        (f,) = found
        assert f.severity == "warning" and f.data["refused"] and "engine core died" in f.title and "#56855" in f.title
        assert r.raised in f.explanation and "None" not in f.title + f.explanation
        (n,) = _notes(r)
        assert n["action"] == "refused" and n["req"] == r.d_req and "fail closed" in kv_load.describe(n)
    elif r.raised is not None:  # 0.2x: ValueError unpacking the per-group lists (#50687)
        assert handled["error"] == r.raised
        (f,) = found
        assert f.severity == SEVERITY_ERROR and r.raised in f.title and f.data["groups"] == 2
        assert f.req == r.d_req
    else:
        assert "error" not in handled and r.computed_after == 0 and r.finished == "FINISHED_LENGTH_CAPPED"
        assert found == []


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_deployment_summary_says_a_failed_load_was_recomputed_only_where_it_was(policy):
    """vLLM's real scheduler and NIXL connector with a failed read (vLLM 0.32 records it DONE and ERR at one step):
    under "fail" the request ends FINISHED_ERROR (vLLM's own status) and nothing is recomputed, so the summary
    says the tokens were lost, not recomputed; under "recompute" D recomputes them. Either way the loaded, lost
    and recomputed tokens add up to what D's connector planned."""
    from pdtrace.detectors import crossed

    r = failed_load(NOSPEC, policy=policy, how="both", steps=8)
    (n,) = [x for x in crossed.pair_notes(r.events) if x["requests"]]
    line = crossed.summary_line(n)
    if policy == "fail":
        assert r.finished == "FINISHED_ERROR"
        assert n.get("load_failed_error_tokens") and not n["load_failed_tokens"] and "recomputed" not in line
        assert "lost to a failed load (the request ended in error" in line
    else:
        assert n["load_failed_tokens"] and "recomputed after a failed load" in line
    planned = n["loaded"] + n["load_failed_tokens"] + n.get("load_failed_error_tokens", 0)
    assert planned == n["prompt_tokens"] - n["local_hit"] - n["computed"]
