"""The token a step in flight at a KV-load rollback sampled, appended after the rollback (issue 50,
item 2; part of the kv-load-failure-recovery class, fed by ``kv_load.Stream``).

Under async scheduling the engine core schedules step n+1 before it processes step n's output.
When step n's output reports a request's blocks as failed, the scheduler cuts the request back
and drops step n's output for it; step n+1, already scheduled, ran on the KV that failed to load.
Its output is processed after the rollback: where ``update_from_output`` appends its token
(``kvload.output``: ``in_flight`` and ``appended`` > 0), a token sampled from that KV reached the
request's output, with no error anywhere (vLLM 0.19-0.33 all append it). A release that drops it
records ``appended`` 0: no finding.

The oracle is vLLM's own request object as the hook reads it: its output token count before and
after that output was processed, and the step the output came from (the scheduler's own output).
"""

from __future__ import annotations

from typing import Any

from .base import KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, Finding

Event = dict[str, Any]


def appended_in_flight(e: Event, rollback: tuple[Event, Event] | None) -> Finding | None:
    """A finding for one ``kvload.output`` whose step was in flight at the rollback and whose token
    was appended; ``rollback``: the request's ``kvload.request`` and ``kvload.handled``, when the
    trace has them."""
    n = int(e.get("appended") or 0)
    if not e.get("in_flight") or n <= 0:
        return None
    req, step, rstep, pos = e.get("req"), e.get("step"), e.get("rollback_step"), int(e.get("position") or 0)
    r, handled = rollback or ({}, {})
    cut = (f", cut back from {r.get('computed_before')} to {r.get('computed')} computed tokens" if r else "")
    return Finding(
        KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, req, step, e.get("inst"),
        [x["id"] for x in (handled, r, e) if "id" in x],
        f"output token {pos} of {req} was sampled on KV that failed to load: step {step}, in flight at the "
        f"rollback, had its token appended after it",
        f"The scheduler handled a failed KV load of {req}{cut}, when the latest step it had scheduled was step "
        f"{rstep}. Step {step} had been scheduled before that (async scheduling schedules the next step before it "
        f"processes the last one's output), so "
        f"it ran with the failed blocks in its context; when its output was processed after the rollback, "
        f"update_from_output appended its {n} token(s) to the request's output (position {pos}"
        f"{'' if n == 1 else f'-{pos + n - 1}'}): the client receives a token computed from KV that never "
        f"arrived, and no error is raised. vLLM drops the output of the step that reported the failure, not the "
        f"one in flight.",
        {"in_flight_step": step, "rollback_step": rstep, "position": pos, "appended": n,
         "computed": r.get("computed"), "policy": r.get("policy") or handled.get("policy")})
