"""kv-load-failure-recovery (issue 36): KV that failed to load, and the recovery that followed.

When D's connector reports a failed load (``kvload.handled``: blocks, or whole requests), the
scheduler either fails the affected requests (``kv_load_failure_policy="fail"``) or cuts their
computed tokens back to the first failed block and recomputes from there ("recompute"). What
the scheduler decided per request is recorded before and after (``kvload.request``). The
findings, per request:

- *recompute did not restart at the first failed block*: the request's computed tokens, as the
  scheduler left them, still cover a block reported failed (from the request's own block list,
  the reported block ids and its computed tokens before the step), and no earlier request of
  the same call recomputes that block (vLLM lets one request recompute a block others share);
- *scheduled beyond what remains after a rollback*: the first step that schedules the request
  after it was cut back gives it more tokens (draft tokens aside) than it has left to compute
  (``num_tokens - computed``). An error when the request still carried output placeholders
  after the rollback (async scheduling; vLLM #49250 / #45138: the placeholders are not rolled
  back, so the recompute runs past the prompt), else a warning;
- *a failed request that never finished*: failed by the policy, but no ``req.finish`` follows;
- *a rolled-back request that never ran again*: its scheduler went on stepping, but no step
  schedules it and it never finishes (a trace whose scheduler stopped stepping cannot tell);
- *stranded after the recompute*: it ran again, then its scheduler went on stepping without it
  (two steps or more) while it kept its blocks, and it never finished (vLLM #45138: the stale
  placeholders trip async scheduling's stop check and the request sits in the running queue);
- *the handler raised* (per scheduler call, not per request): the engine core's step does not
  catch it, one failed load ends the instance (multi-group models: vLLM #50687 on 0.2x). vLLM
  0.32+'s deliberate refusal of block-level failures on such models (#56855, "fail closed", which
  vLLM's own tests expect) is a warning: by design, but the instance died (the requests its last
  step scheduled are listed as lost), and a fact per request.

Oracles are vLLM's own values as the hooks read them (block lists, num_computed_tokens,
num_tokens, num_output_placeholders, the scheduled token counts), never another detector.
"""

from __future__ import annotations

from typing import Any

from .kv_inflight import appended_in_flight
from .kv_shared import scheduled as shared_scheduled, watch as shared_watch
from .base import KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, SEVERITY_WARNING, Finding
from .index import feed_all, kind_code

Event = dict[str, Any]

_KINDS = ("kvload.handled", "kvload.request", "sched.step", "req.finish", "sched.free", "kvload.error",
          "kvload.output")
STRANDED = 2  # steps of its scheduler without the request, after it last ran, before it counts as stranded
KEPT = 1 << 14  # open rollbacks / failed requests kept per stream (the oldest go first)


class Stream:
    """The detector over events fed in trace order. It keeps, per scheduler (``_where``: pid,
    instance, the config before the event), the last handled failure's block ids (until that step's requests are read), the rollbacks waiting
    for the request's next step, and the failed requests waiting for their finish."""

    KINDS = _KINDS

    def __init__(self, header: dict | None = None):
        # keys: a scheduler (pid, inst, config id; ``_where``), then the request id
        self.calls: dict[tuple, tuple[Event, list]] = {}  # scheduler -> (handled, its requests so far)
        self.steps: dict[tuple, Event] = {}  # scheduler -> its latest sched.step
        self.waiting: dict[tuple, tuple[Event, Event]] = {}  # (*scheduler, req) -> (request, handled): next step
        self.failed: dict[tuple, tuple[Event, Event]] = {}  # (*scheduler, req) -> (request, handled): a finish
        self.passed: dict[tuple, int] = {}  # (*scheduler, req) waiting -> steps of its scheduler without it
        self.after: dict[tuple, list] = {}  # ran again after a rollback: [request, handled, steps without it since]
        self.findings: list[Finding] = []
        self.configs: Any = None
        self.told: dict[tuple, dict] = {}  # (*scheduler, req) -> what happened to it (``outcomes``)
        self.loads_failed: dict[Any, list] = {}  # instance -> its worker's kvload.error events since its last handling
        self.rollbacks: dict[tuple, tuple[Event, Event]] = {}  # (*scheduler, req) -> its last rollback
        self.shared: dict[tuple, Any] = {}  # (*scheduler, block) -> kv_shared.Watch: a failed block kept until rewritten

    def _where(self, e: Event) -> tuple:
        """The scheduler an event is from: its process and instance, and the scheduler config
        before it there (one process may build several schedulers in turn: vLLM's own tests)."""
        c = self.configs.config_of(e) if self.configs is not None else None
        return (e.get("pid"), e.get("inst"), (c or {}).get("id"))

    def feed(self, idx: Any) -> None:
        self.configs = idx.configs
        if not idx.kind("kvload.handled") and not idx.kind("kvload.error") and not idx.kind("kvload.output") \
                and not self.waiting and not self.failed \
                and not self.after and not self.shared:
            # no failure to follow: only each scheduler's latest step (a failure handled at the
            # start of the next segment reads the tokens its step scheduled)
            for e in idx.kind("sched.step"):
                self.steps[self._where(e)] = e
            return
        HANDLED, REQUEST, STEP, FINISH, FREE, ERROR, OUTPUT = (kind_code(k) for k in _KINDS)
        for e, k in zip(*idx.ordered_codes(_KINDS)):
            where = self._where(e)
            if k == STEP:
                self.steps[where] = e
                if self.waiting or self.after:
                    self._scheduled(where, e)
                if self.shared:
                    shared_scheduled(self.shared, where, e, self.findings, self._block_size(e) or 16)
            elif k == ERROR:  # D's worker: a failed load, of which request (the scheduler's handler follows)
                if e.get("req") is not None and len(self.loads_failed) < KEPT:
                    self.loads_failed.setdefault(e.get("inst"), []).append(e)
            elif k == HANDLED:
                self.calls[where] = (e, [])
                errs = self.loads_failed.pop(e.get("inst"), [])
                if e.get("error") and refused(e.get("error")):
                    self._tell_refused(where, e, errs)
                    self._crashed(e, errs, where, by_design=True)
                elif e.get("error"):
                    self._crashed(e, errs, where)
            elif k == REQUEST:
                call = self.calls.get(where)
                if call is None or call[0].get("step") != e.get("step") or call[0].get("source") != e.get("source"):
                    continue  # (its kvload.handled is not in the trace)
                self._request(where, e, call)
            elif k == OUTPUT:  # after a rollback: a step's output appended to the request
                f = appended_in_flight(e, self.rollbacks.get((*where, e.get("req"))))
                if f is not None:
                    self.findings.append(f)
            elif k == FINISH or k == FREE:  # (freed: finished, or preempted and left the batch)
                key = (*where, e.get("req"))
                self.after.pop(key, None)
                if k == FINISH and key in self.told:
                    self.told[key].setdefault("finished", {"step": e.get("step"), "status": e.get("status"),
                                                           "output_tokens": e.get("num_output_tokens")})
                if k == FINISH:
                    self.failed.pop(key, None)
                    self.waiting.pop(key, None)
                    self.passed.pop(key, None)
        for d in (self.waiting, self.failed, self.after):
            while len(d) > KEPT:
                del d[next(iter(d))]

    def _request(self, where: tuple, e: Event, call: tuple[Event, list]) -> None:
        handled, earlier = call
        key = (*where, e.get("req"))
        self._tell(key, e, handled)
        if e.get("action") == "fail" or e.get("req") in (handled.get("failed") or ()):
            self.failed[key] = (e, handled)
            self.waiting.pop(key, None)
        elif e.get("computed", 0) < e.get("computed_before", 0) or e.get("retry"):
            self.waiting[key] = (e, handled)
        if handled.get("source") == "invalid_blocks" and e.get("policy") == "recompute":
            self._check_restart(where, e, handled, earlier)
        earlier.append(e)
        if e.get("action") == "recompute" and len(self.rollbacks) < KEPT:
            self.rollbacks[key] = (e, handled)

    def _tell_refused(self, where: tuple, h: Event, errs: list[Event]) -> None:
        """vLLM 0.32+ refusing block-level failures of a multi-group model is its design (fail closed,
        #56855; vLLM's own test_block_level_load_failure_fails_closed_with_multiple_groups expects
        it): a fact per request whose load failed, not a finding."""
        for x in errs or [{"req": None}]:
            key = (*where, x.get("req"))
            if key not in self.told and len(self.told) < KEPT:
                self.told[key] = {"inst": where[1], "req": x.get("req"), "step": h.get("step"),
                                  "source": h.get("source"), "policy": h.get("policy"), "action": "refused",
                                  "retry": False, "error": h.get("error"), "groups": h.get("groups"),
                                  "blocks": len(h.get("block_ids") or []), "failed_blocks": None, "failures": 1,
                                  "events": [y["id"] for y in (x, h) if "id" in y]}

    def _crashed(self, h: Event, errs: list[Event], where: tuple = (), by_design: bool = False) -> None:
        """The scheduler's failure handler raised: nothing catches it in the engine core's step, so
        the engine exits and every request on the instance with it, for one failed load (named
        by the worker's failure record before it, when the trace has one). Where vLLM raises by
        design (0.32+ refusing block-level failures of a multi-group model, #56855) a warning: the
        instance died all the same, and the user must hear it first."""
        groups = h.get("groups") or 1
        reqs = list(dict.fromkeys(str(x["req"]) for x in errs))
        last = self.steps.get(where) or {}
        lost = sorted(map(str, (last.get("tokens") or {}).keys()))  # the requests its last step scheduled
        if by_design:
            self.findings.append(Finding(
                KV_LOAD_FAILURE_RECOVERY, SEVERITY_WARNING, reqs[0] if reqs else None, h.get("step"), h.get("inst"),
                [x["id"] for x in (*errs, h) if "id" in x],
                f"the engine core died: vLLM refused a block-level KV load failure on a model with {groups} KV cache "
                f"groups (by design, #56855)",
                f"The connector reported {len(h.get('block_ids') or [])} failed block(s) ({h.get('source')}) on a "
                f"model with {groups} KV cache groups, and the scheduler raised {h.get('error')}: vLLM 0.32+ fails "
                f"closed there on purpose (vLLM #56855; its own test_block_level_load_failure_fails_closed_with_"
                f"multiple_groups expects it), and nothing in the engine core's step catches it, so the engine core "
                f"exits and no request on the instance finishes"
                + (f": {len(lost)} request(s) its last step scheduled were lost ({', '.join(lost[:6])}"
                   + (" ..." if len(lost) > 6 else "") + ")" if lost else "")
                + ". A connector that reports failed requests (failed_recving) instead of blocks lets vLLM "
                  "recompute them.",
                {"error": h.get("error"), "groups": groups, "source": h.get("source"), "policy": h.get("policy"),
                 "failed_loads": reqs, "refused": True, "lost": lost}))
            return
        why = (f"With {groups} KV cache groups: vLLM 0.2x unpacks one block list per request and raises "
               f"ValueError on a multi-group (hybrid) model (vLLM #50687, fixed by #50388 in 0.30); 0.32+ refuses "
               f"block-level failures of multi-group models with RuntimeError (#56855: the connector must report "
               f"failed requests, failed_recving)" if groups > 1 else "")
        self.findings.append(Finding(
            KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, reqs[0] if reqs else None, h.get("step"), h.get("inst"),
            [x["id"] for x in (*errs, h) if "id" in x],
            f"the scheduler raised handling a KV load failure ({h.get('source')}): {h.get('error')}",
            f"The connector reported a failed load ({h.get('source')}: {len(h.get('block_ids') or h.get('reqs') or [])} "
            f"block(s) or request(s)), and the scheduler's handler raised {h.get('error')}. Nothing in the engine "
            f"core's step catches it: the engine exits, and every request on the instance fails for one failed "
            f"load. " + (why + "." if why else ""),
            {"error": h.get("error"), "groups": groups, "source": h.get("source"), "policy": h.get("policy"),
             "failed_loads": reqs, "lost": lost}))

    def _tell(self, key: tuple, e: Event, handled: Event) -> None:
        """What the scheduler decided for the request, kept for ``notes``: its first failed load
        (vLLM 0.30+ handles one failed receive twice in a step, the request then its blocks: one
        load, the blocks from the second), and how many loads of it failed in all."""
        n = self.told.get(key)
        if n is not None:
            if n["step"] != e.get("step"):
                n["failures"] += 1
            else:
                same_step(n, e, handled)
            return
        if len(self.told) < KEPT:
            self.told[key] = note(e, handled)

    def _block_size(self, e: Event) -> int | None:
        c = self.configs.config_of(e) if self.configs is not None else None
        sizes = (c or {}).get("block_sizes") or []
        return int(sizes[0]) if sizes else None

    def _check_restart(self, where: tuple, e: Event, handled: Event, earlier: list[Event]) -> None:
        B = self._block_size(e)
        blocks = (e.get("block_ids") or [[]])[0]
        bad = set(handled.get("block_ids") or ())
        if not B or not blocks or not bad:
            return
        step = self.steps.get(where)
        this_step = ((step or {}).get("tokens") or {}).get(e.get("req"), 0) if (step or {}).get("step") == e.get(
            "step") else 0
        had = e.get("computed_before", 0) - this_step  # computed before this step's tokens (vLLM's own rule)
        n_blocks = -(-had // B)
        first = next((i for i, b in enumerate(blocks[:n_blocks]) if b in bad), None)
        if first is None or e.get("computed", 0) <= first * B:
            return
        block = blocks[first]
        # earlier requests of the call recompute every failed block it keeps (vLLM's shared-block rule):
        # followed until they have (kv_shared), else a recompute that did not restart
        if shared_watch(self.shared, where, e, handled, earlier, B, blocks, bad, had):
            return
        self.findings.append(Finding(
            KV_LOAD_FAILURE_RECOVERY, SEVERITY_ERROR, e.get("req"), e.get("step"), e.get("inst"),
            [x["id"] for x in (handled, e) if "id" in x],
            f"recompute did not restart at the first failed block: {e.get('req')} keeps {e.get('computed')} "
            f"computed tokens, block {block} (index {first}) failed to load",
            f"The connector reported block(s) {sorted(bad)[:8]} as failed to load. Request {e.get('req')} held "
            f"block {block} at index {first} of its blocks, inside the {had} tokens it had computed (block size "
            f"{B}), so a recompute must restart at token {first * B} or before; the scheduler left it at "
            f"{e.get('computed')} tokens, and no earlier request of this step recomputes that block. Its next "
            f"steps read KV that never arrived.",
            {"block": block, "index": first, "block_size": B, "computed": e.get("computed"),
             "restart_at": first * B, "failed_blocks": sorted(bad), "policy": e.get("policy")}))

    def _scheduled(self, where: tuple, step: Event) -> None:
        tokens = step.get("tokens") or {}
        spec = step.get("spec") or {}
        for key in self.waiting:
            if key[:3] == where and key[3] not in tokens:
                self.passed[key] = self.passed.get(key, 0) + 1
        for key, st in self.after.items():
            if key[:3] == where:
                st[2] = 0 if key[3] in tokens else st[2] + 1
        for req, n in tokens.items():
            key = (*where, req)
            hit = self.waiting.pop(key, None)
            self.passed.pop(key, None)
            if hit is None:
                continue
            if key in self.told:
                self.told[key].setdefault("ran_again", step.get("step"))
            e, handled = hit
            self.after[key] = [e, handled, 0]
            n_new = int(n) - int(spec.get(req, 0) or 0)
            left = int(e.get("num_tokens", 0)) - int(e.get("computed", 0))
            if n_new <= left:
                continue
            ph = int(e.get("placeholders", 0) or 0)
            sev = SEVERITY_ERROR if ph else SEVERITY_WARNING
            why = (f"it still carried {ph} output placeholder(s) after the rollback (async scheduling reserves "
                   f"them for tokens in flight; they were not rolled back with its computed tokens)" if ph else
                   "it carried no output placeholders: the trace does not say where the extra tokens came from")
            self.findings.append(Finding(
                KV_LOAD_FAILURE_RECOVERY, sev, req, step.get("step"), step.get("inst"),
                [x["id"] for x in (handled, e, step) if "id" in x],
                f"scheduled {n_new} token(s) after a KV load rollback, {n_new - left} more than the {left} it had "
                f"left to compute",
                f"After the failed load (step {e.get('step')}), the scheduler cut {req} back to {e.get('computed')} "
                f"computed tokens of {e.get('num_tokens')}; at step {step.get('step')} it scheduled {n_new} "
                f"token(s) for it (draft tokens aside), {n_new - left} past the end of what it holds: {why}. The "
                f"recompute runs past the request's tokens (vLLM #49250 / #45138).",
                {"scheduled": n_new, "left": left, "computed": e.get("computed"), "num_tokens": e.get("num_tokens"),
                 "placeholders": ph, "rollback_step": e.get("step"), "policy": e.get("policy")}))

    def _flag(self, severity: str, key: tuple, e: Event, handled: Event, title: str, why: str, data: dict) -> None:
        self.findings.append(Finding(KV_LOAD_FAILURE_RECOVERY, severity, key[3], e.get("step"), key[1],
                                     [x["id"] for x in (handled, e) if "id" in x], title, why, data))

    def finish(self) -> list[Finding]:
        for key, (e, handled) in self.failed.items():
            req = key[3]
            self._flag(SEVERITY_ERROR, key, e, handled, f"{req} was failed for a KV load failure but never finished",
                       f"The scheduler failed {req} at step {e.get('step')} (policy {e.get('policy')}, "
                       f"{e.get('source')}), but no req.finish follows in the trace: the client waits for a request "
                       f"the engine dropped, and its blocks stay held.",
                       {"policy": e.get("policy"), "source": e.get("source")})
        for key, (e, handled) in self.waiting.items():
            req, passed = key[3], self.passed.get(key, 0)
            if not passed:
                continue  # (its scheduler did not step again in the trace: nothing to tell)
            self._flag(SEVERITY_WARNING, key, e, handled, f"{req} was rolled back after a KV load failure and never "
                       f"ran again",
                       f"At step {e.get('step')} the scheduler cut {req} back to {e.get('computed')} computed tokens "
                       f"({'queued for a retry of its load' if e.get('retry') else 'to recompute'}), but none of the "
                       f"{passed} step(s) its scheduler ran after that schedules it, and it never finishes in the "
                       f"trace.",
                       {"computed": e.get("computed"), "retry": bool(e.get("retry")), "policy": e.get("policy"),
                        "steps_without_it": passed})
        for key, (e, handled, missed) in self.after.items():
            if missed < STRANDED:
                continue
            req = key[3]
            self._flag(SEVERITY_WARNING, key, e, handled, f"{req} stalled after its KV load recompute: {missed} "
                       f"step(s) without it, never finished",
                       f"After the failed load (step {e.get('step')}) the scheduler cut {req} back to "
                       f"{e.get('computed')} computed tokens; the request ran again, then its scheduler ran {missed} "
                       f"step(s) without it while it kept its blocks, and it never finished in the trace. With "
                       f"output placeholders left after the rollback ({e.get('placeholders', 0)} here), async "
                       f"scheduling's stop check can leave a request in the running queue for good (vLLM #45138).",
                       {"steps_without_it": missed, "placeholders": e.get("placeholders"),
                        "computed": e.get("computed"), "policy": e.get("policy")})
        self.failed, self.waiting, self.passed, self.after, self.loads_failed = {}, {}, {}, {}, {}
        out, self.findings = self.findings, []
        return out

    def notes(self) -> list[dict]:
        """Per request a failed load touched, what happened (``pdtrace check`` prints them; facts,
        not findings): its scheduler's decision (``action``: fail, recompute, retry or none),
        computed tokens before and after, its failed blocks, the step it ran again at and its
        finish (status, step), in trace order."""
        return list(self.told.values())


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


def _failed_of(e: Event, handled: Event) -> tuple[list[int], list[int] | None]:
    """The request's blocks (group 0) and those of them the handled call reported failed (None:
    the call reported no blocks, e.g. failed_recving)."""
    bad = set(handled.get("block_ids") or ())
    blocks = (e.get("block_ids") or [[]])[0]
    return blocks, ([b for b in blocks if b in bad] if bad else None)


def note(e: Event, handled: Event) -> dict:
    """One request's note (``Stream.notes``, the viewer's Block map box) from its ``kvload.request``
    and the ``kvload.handled`` of that call."""
    blocks, failed = _failed_of(e, handled)
    return {"inst": e.get("inst"), "req": e.get("req"), "step": e.get("step"), "source": e.get("source"),
            "policy": e.get("policy"), "action": e.get("action"), "retry": bool(e.get("retry")),
            "computed_before": e.get("computed_before"), "computed": e.get("computed"),
            "num_tokens": e.get("num_tokens"), "blocks": len(blocks), "failed_blocks": failed, "failures": 1,
            "events": [x["id"] for x in (handled, e) if "id" in x]}


def same_step(n: dict, e: Event, handled: Event) -> None:
    """A second decision on the request in the note's step (the blocks after the request): the
    failed blocks from it when the first had none."""
    _blocks, failed = _failed_of(e, handled)
    if n["failed_blocks"] is None and failed is not None:
        n["failed_blocks"] = failed


def refused(error: str) -> bool:
    """vLLM 0.32+'s deliberate refusal of block-level failures on a multi-group model (#56855)."""
    return error.startswith("RuntimeError") and "multiple KV cache groups" in error


def describe(n: dict) -> str:
    """One request's ``notes()`` entry in words: the decision, then what followed."""
    fb = n.get("failed_blocks")
    blocks = (f"{len(fb)} of its {n.get('blocks')} block(s) failed to load (D block id(s) "
              f"{', '.join(map(str, fb[:8]))}{', ...' if len(fb) > 8 else ''})" if fb else
              f"none of its {n.get('blocks')} block(s) among those reported failed" if fb is not None else
              "its load failed" + (f" ({n.get('blocks')} block(s))" if n.get("blocks") else ""))
    act = n.get("action")
    if act == "refused":
        return (f"step {n.get('step')}, policy {n.get('policy')}: the connector reported {n.get('blocks')} failed "
                f"block(s) of a model with {n.get('groups')} KV cache groups; vLLM refused them by design (fail "
                f"closed, #56855: the scheduler raised RuntimeError, which ends its engine core; the connector "
                f"must report failed requests, failed_recving)")
    if act == "fail":
        what = "failed by the policy"
    elif act == "recompute":
        what = (f"cut back from {n.get('computed_before')} to {n.get('computed')} computed tokens"
                + (", queued to be scheduled again" if n.get("retry") else "") + ", recomputes from there")
    else:
        what = f"kept at {n.get('computed')} computed tokens (another request recomputes its failed blocks)"
    out = f"step {n.get('step')}, policy {n.get('policy')}: {blocks}; {what}"
    if n.get("failures", 1) > 1:
        out += f"; {n['failures']} failed loads in all"
    if n.get("ran_again") is not None:
        out += f"; ran again at step {n['ran_again']}"
    fin = n.get("finished")
    out += (f"; finished at step {fin.get('step')} ({fin.get('status')}, {fin.get('output_tokens')} output token(s))"
            if fin else "; no finish in the trace")
    return out
