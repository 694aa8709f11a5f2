"""The KV-load and KV-crossing families of ``real_release`` (issues 36, 50, 51): each on the
installed release's own scheduler code, no planted fault where the release behaves so; the
oracle in each function's docstring, from vLLM's own objects."""

from __future__ import annotations


class NotRunnable(Exception):
    """A family whose code this release does not have in a form that runs on CPU; the reason."""


KV_LOAD_RUNS = ((False, (0,)), (False, (2,)), (False, None), (True, (0,)), (True, (2,)), (True, None))


def kv_load_family() -> tuple[list[dict], list[dict]]:
    """vLLM #49250 (part 2) / #45138, open upstream: a running request's blocks reported failed
    (a synchronous load, as vLLM's own tests report it), policy "recompute", on the release's own
    Scheduler and AsyncScheduler. Oracle: vLLM's objects, read right after the failure was handled
    (the request's num_tokens and num_computed_tokens) against the tokens the release's scheduler
    gave it on the next step: wrong when more than it had left."""
    from pdtrace.testing import pd_harness as pd
    from pdtrace.testing.kv_load_sim import failed_load

    events: list[dict] = []
    cases = []
    for async_scheduling, failed in KV_LOAD_RUNS:
        cfg = pd.PDConfig(spec_method="", async_scheduling=async_scheduling)
        r = failed_load(cfg, policy="recompute", how="blocks", when="running", failed=failed, max_tokens=8, steps=10)
        left = (r.num_tokens_after or 0) - (r.computed_after or 0)
        events += r.events  # (write_scenario_trace drops their ids)
        cases.append({"family": "kv-load-rollback", "req": r.d_req, "wrong": r.scheduled_after[0] > left,
                      "facts": {"async_scheduling": async_scheduling, "failed": failed, "d_local": r.d_local,
                                "computed_after": r.computed_after, "num_tokens_after": r.num_tokens_after,
                                "scheduled_after": r.scheduled_after, "finished": r.finished}})
    return events, cases


def kv_load_hybrid_family() -> tuple[list[dict], list[dict]]:
    """A model with two KV cache groups (full attention + sliding window) whose load fails,
    reported as blocks, under each policy, on the release's own Scheduler. 0.19-0.28 unpack one
    block list per request and raise ValueError (vLLM #50687); 0.30 recomputes the whole request
    (#50388); 0.32+ refuse block-level failures of multi-group models with RuntimeError (#56855).
    Oracle: whether the release's scheduler raised (nothing in the engine core's step catches it:
    the instance exits for one failed load), other than the refusal vLLM's own tests expect."""
    from pdtrace.testing import pd_harness as pd
    from pdtrace.testing.kv_load_sim import failed_load

    events: list[dict] = []
    cases = []
    for policy in ("fail", "recompute"):
        cfg = pd.PDConfig(spec_method="", attn=("full", "sliding"))
        r = failed_load(cfg, policy=policy, how="blocks", steps=6)
        events += r.events  # (write_scenario_trace drops their ids)
        # vLLM 0.32+'s refusal is its design (its own test_block_level_load_failure_fails_closed_with_
        # multiple_groups expects the RuntimeError): not wrong; the 0.2x ValueError is the bug (#50687)
        designed = r.raised is not None and r.raised.startswith("RuntimeError") and "multiple KV cache groups" in r.raised
        cases.append({"family": "kv-load-hybrid", "req": r.d_req, "wrong": r.raised is not None and not designed,
                      "facts": {"policy": policy, "raised": r.raised, "computed_after": r.computed_after,
                                "finished": r.finished}})
    return events, cases


def kv_load_in_flight_family() -> tuple[list[dict], list[dict]]:
    """Issue 50 item 2: a running request's blocks reported failed under async scheduling in the
    engine core's order (step n+1 scheduled before step n's output is processed), policy
    "recompute" (``kv_inflight_sim``). Oracle: the release's own request object: whether the token
    sampled by the step in flight at the rollback is in its output_token_ids."""
    from pdtrace.testing.kv_inflight_sim import in_flight_rollback

    events: list[dict] = []
    cases = []
    for i, failed in enumerate(((2,), (0,))):
        r = in_flight_rollback(failed=failed, tag=f"inflight{i}")
        events += r.events  # (write_scenario_trace drops their ids)
        cases.append({"family": "kv-load-in-flight", "req": r.d_req, "wrong": r.appended,
                      "facts": {"failed": failed, "rollback_step": r.rollback_step, "in_flight_step": r.in_flight_step,
                                "in_flight_token": r.in_flight_token, "output": r.output}})
    return events, cases


def kv_load_shared_family() -> tuple[list[dict], list[dict]]:
    """Issue 50 item 1: two requests share D's prefix-cache blocks, both blocks fail; with chunked
    prefill (long_prefill_token_threshold 16) the second reads them before the first rewrites them,
    without it nothing is read early (``kv_shared_sim``). Oracle: vLLM's objects per step (the
    scheduler's output, the first request's computed tokens, its block list)."""
    from pdtrace.testing.kv_shared_sim import shared_block_failure

    events: list[dict] = []
    cases = []
    for lp in (16, 0):
        r = shared_block_failure(lp, tag=f"shared{lp}")
        if not r.shared:
            raise NotRunnable("no shared block: the second request did not get the first's blocks from D's prefix cache "
                              "on this release's scheduler in pdtrace's harness (it prefilled them itself)")
        events += r.events  # (write_scenario_trace drops their ids)
        for rid, kept in r.kept.items():
            cases.append({"family": "kv-load-shared", "req": rid, "wrong": any(w[0] == rid for w in r.wrong),
                          "facts": {"long_prefill_token_threshold": lp, "failed": r.failed, "computed_after": kept,
                                    "read_before_rewrite": [list(w) for w in r.wrong if w[0] == rid]}})
    return events, cases


def kv_reown_in_flight_family() -> tuple[list[dict], list[dict]]:
    """Issue 59, must show 3 (vLLM #37285, fixed by PR #45357 in 0.24): a request stops while its next step is in
    flight under async scheduling, and a request that loads its KV from P gets its blocks; that step writes the first
    request's KV where the load lands (a 40-token load) or past it (an 8-token load: nothing B loads is written)
    (``kv_reown_sim``). Oracle: vLLM's objects: the in-flight step's scheduled tokens, the requests' block lists and
    computed tokens, which outputs the engine order had processed."""
    from pdtrace.testing.kv_reown_sim import reown_in_flight

    events: list[dict] = []
    cases = []
    for i, n in enumerate((40, 8)):
        r = reown_in_flight(b_prompt_len=n, tag=f"reown{i}")
        events += r.events  # (write_scenario_trace drops their ids)
        cases.append({"family": "kv-reown-in-flight", "req": r.b_req, "wrong": bool(r.reowned),
                      "facts": {"loads": n, "in_flight_step": r.in_flight_step, "b_step": r.b_step,
                                "reowned": r.reowned, "finished": r.a_req}})
    return events, cases


def kv_prune_in_flight_family() -> tuple[list[dict], list[dict]]:
    """Issue 59, must show 3 (vLLM #47282, fixed by PR #47728 in 0.26): under async scheduling the next schedule()
    prunes a sliding-window block a step in flight still reads, and a request that loads its KV from P gets it; the
    load lands where that step reads (a 32-token load) or misses it (an 8-token load into the same block)
    (``kv_prune_sim``). Oracle: vLLM's objects: each step's scheduled tokens, the requests' block lists and computed
    tokens, which outputs the engine order had processed. The request named is the one whose window was pruned."""
    from pdtrace.testing.kv_prune_sim import prune_in_flight

    events: list[dict] = []
    cases = []
    for i, (n, extra) in enumerate(((32, 1), (8, 0))):
        r = prune_in_flight(b_prompt_len=n, extra=extra, tag=f"prune{i}")
        events += r.events  # (write_scenario_trace drops their ids)
        cases.append({"family": "kv-prune-in-flight", "req": r.a_req, "wrong": bool(r.reowned),
                      "facts": {"loads": n, "b_step": r.b_step, "handed": r.handed, "reowned": r.reowned,
                                "loader": r.b_req}})
    return events, cases


def kv_never_crossed_family() -> tuple[list[dict], list[dict]]:
    """Issue 51: prompts P prefilled for a remote decode on the release's own P and D schedulers,
    two of six handed to D without P's params (the router's labelled fault; ``crossed_sim``). The
    release's code decides what D loads. Oracle: vLLM's own numbers from D's first output for each
    request (PrefillStats, 0.20+; num_cached_tokens, 0.19): a request P prefilled whose prompt D
    computed whole. Checks the detector reads every release's recorded events alike."""
    from pdtrace.testing.crossed_sim import dropped_params, prefilled_again

    r = dropped_params(drop=(1, 4))
    events = r.events
    again = set(prefilled_again(r))
    cases = [{"family": "kv-never-crossed", "req": rid, "wrong": rid in again,
              "facts": {"dropped": rid in r.dropped, "sent_to_d_alone": rid in r.direct, "vllm": s}}
             for rid, s in sorted(r.stats.items())]
    return events, cases
