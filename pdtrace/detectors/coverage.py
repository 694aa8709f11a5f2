"""Coverage: could each bug class be decided on this trace?

A detector that finds nothing is only worth "clean" when the events it reads are in the
trace and the hooks that emit them raised no errors. ``coverage(events, header, footer)``
answers that per bug class with one of three statuses:

- ``checked``: the class's events are present and none of its hooks failed; its findings
  (or their absence) are a verdict.
- ``not-applicable``: the recorded configuration says the bug cannot occur here (e.g. no
  speculative decoding, no instance that saves KV, a model runner without the code path);
  decided from ``sched.config`` / the ``runner`` field of worker events, or from an event
  that says so (``acc.device``: model runner V2 keeps accepted counts on the device), never
  from an absence of events.
- ``not-checked``: a hook feeding the class raised (``hook.error`` events, footer /
  ``proc.exit`` ``hook_errors``), a process emitting its events dropped events, a worker
  ran a model runner pdtrace has no hooks for this class on (the ``runner`` event,
  hooks/runner.py; a ``ClassSpec.unhooked`` entry), a V2 worker did not record the event
  that rules the class out there (``ClassSpec.na_when``), or its events are simply not
  there; ``reason`` says which. Never reported clean.

Everything class-specific sits in the ``CLASSES`` table; the code below only evaluates it. Pure Python over
loaded events: no vLLM / torch import. (The KV invariant's reads it could not judge: ``kv_invariant.coverage``.)
"""

from __future__ import annotations

import dataclasses
import fnmatch
from itertools import repeat
from typing import Any, Callable

from .base import (
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION,
    KV_INVARIANT,
    KV_LOAD_FAILURE_RECOVERY,
    KV_NEVER_CROSSED,
    LOOKAHEAD_MISALIGNMENT,
    METADATA_CLEARED_BEFORE_DRAFTER,
    STALE_ACCEPTED_COUNT_READ,
)
# (re-exported: what a damaged trace lacks is the trace file's business, said once for every command)
from ..tracefile.damage import damaged_lines, footer_damage, incomplete_reason  # noqa: F401
from .coverage_rules import (LOADING_ROLES, NO_KV_DRAFTERS, SAVING_ROLES, _no_connector, _no_kv_drafter,  # noqa: F401
                             _no_lookahead, _no_spec, _no_state_group, _not_loading, _not_saving)
from .index import build

Event = dict[str, Any]

CHECKED = "checked"
NOT_APPLICABLE = "not-applicable"
NOT_CHECKED = "not-checked"

# worker events that may name their model runner (``runner``: "v1" | "v2"; absent = unknown);
# ``runner`` (hooks/runner.py) is the one every worker emits when it builds its runner
RUNNER_KINDS = ("runner", "kvmeta.bind", "spec.phase", "d2h.issue", "acc.read", "batch.add", "acc.device")
RUNNER_NAMES = {"v1": "model runner V1", "v2": "model runner V2"}

ConfigRule = Callable[[Event], bool]


@dataclasses.dataclass(frozen=True)
class ClassSpec:
    """What decides one bug class.

    feeds: (event kind, {field: value} filter) pairs; the class is decidable from the
    trace when at least one such event is present. needs: kinds that must be present as
    well (e.g. ``sched.config`` for block sizes). hooks: fnmatch patterns of the hook
    names (``pdtrace doctor``) whose errors make the verdict unsafe. rules: (predicate on
    one ``sched.config``, reason); when the predicate holds for EVERY recorded scheduler
    config (and no scheduler hook failed) the class does not apply. runners: model runner
    (the ``runner`` field of worker events) -> why the class does not apply on it.
    unhooked: model runner -> what pdtrace has no hooks for on it; when any worker ran it,
    the class is not checked (its events from that worker cannot exist). runner_hooks:
    hook-name patterns of the model-runner hooks that produce the class's feeding events
    (``pdtrace doctor`` tells from them whether the class is recorded under each runner).
    na_when: model runner -> (event kind, reason): the class does not apply to a worker on
    that runner that recorded such an event (matched by pid; every worker named by a
    ``runner`` event must have one); a worker on it without one leaves the class not checked.
    """

    feeds: tuple[tuple[str, dict[str, Any]], ...]
    hooks: tuple[str, ...]
    needs: tuple[str, ...] = ()
    rules: tuple[tuple[ConfigRule, str], ...] = ()
    runners: dict[str, str] = dataclasses.field(default_factory=dict)
    unhooked: dict[str, str] = dataclasses.field(default_factory=dict)
    runner_hooks: tuple[str, ...] = ()
    na_when: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    side: str = ""  # where the events come from, for "not checked" texts
    # why the class is not checked when no recorded scheduler saves KV (only D's side is in the trace)
    one_side: str = ""
    # hooks one of which must have been applied (hooks.status / the footer) for the class to be
    # checked: for a class whose own events appear only when the bug's path runs (a failed load),
    # a trace recorded without them says nothing either way
    applied: tuple[str, ...] = ()
    # (hook, what does not run without it): a rule of the class that needs a hook the trace was recorded without
    partial: tuple[tuple[str, str], ...] = ()


_SCHED_HOOKS = ("scheduler.init", "scheduler.<import>")

CLASSES: dict[str, ClassSpec] = {
    LOOKAHEAD_MISALIGNMENT: ClassSpec(
        feeds=(("nixl.request_finished", {"side": "P"}), ("nixl.remote_alloc", {})),
        needs=("sched.config",),
        hooks=(*_SCHED_HOOKS, "nixl.request_finished*", "nixl.remote_alloc", "nixl.trim*", "nixl.read",
               "nixl.<import>"),
        rules=((_no_connector, "no KV connector is configured (no P/D transfer)"),
               (_no_lookahead, "no scheduler reserves lookahead slots (num_lookahead_tokens = 0)")),
        side="P-side nixl.request_finished or D-side nixl.remote_alloc events (engine core)",
    ),
    METADATA_CLEARED_BEFORE_DRAFTER: ClassSpec(
        feeds=(("spec.phase", {"phase": "drafter"}),),
        needs=("kvmeta.bind",),
        hooks=("connector_metadata.*", "spec_v2.target_forward", "spec_v2.propose*", "spec_v2.init_speculator",
               "spec_v2.<import>"),
        rules=((_not_saving, "no instance saves KV (no kv_producer / kv_both scheduler)"),
               (_no_kv_drafter, "no drafter with its own KV layers (no spec decode, or ngram-like method)")),
        runner_hooks=("connector_metadata.target_forward", "connector_metadata.drafter_propose*",
                      "spec_v2.target_forward", "spec_v2.propose*"),
        side="drafter spec.phase events (worker)",
    ),
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION: ClassSpec(
        feeds=(("spec.window", {}),),
        needs=("sched.alloc", "sched.config"),
        hooks=(*_SCHED_HOOKS, "scheduler.allocate_slots", "scheduler.schedule", "accepted_counts.window",
               "accepted_counts.<import>", "spec_v2.propose*", "spec_v2.init_speculator", "spec_v2.<import>"),
        rules=((_no_kv_drafter, "no drafter writes KV (no spec decode, or ngram-like method)"),),
        runner_hooks=("accepted_counts.window", "spec_v2.propose*"),
        side="spec.window events (worker)",
    ),
    STALE_ACCEPTED_COUNT_READ: ClassSpec(
        feeds=(("acc.read", {}), ("d2h.issue", {})),
        hooks=("accepted_counts.issue", "accepted_counts.read", "accepted_counts.truth",
               "accepted_counts.<import>", "input_batch.*", "states_v2.acc_device", "states_v2.<import>"),
        rules=((_no_spec, "no speculative decoding (no accepted counts)"),
               (_no_state_group, "no state (Mamba / SSM) KV cache group: vLLM copies accepted counts to the "
                                 "CPU only for hybrid models")),
        # V2 (gpu/model_states/mamba_hybrid.py) keeps the counts on the device, per request slot;
        # hooks/states_v2.py records that (acc.device) when the model state is built
        na_when={"v2": ("acc.device", "model runner V2 keeps the accepted counts on the device, one per request "
                                      "slot (acc.device): no CPU copy to read stale")},
        runner_hooks=("accepted_counts.issue", "accepted_counts.read", "states_v2.acc_device"),
        side="d2h.issue or acc.read events (worker)",
    ),
    KV_LOAD_FAILURE_RECOVERY: ClassSpec(
        feeds=(("sched.config", {"kv_role": "kv_consumer"}), ("sched.config", {"kv_role": "kv_both"})),
        hooks=(*_SCHED_HOOKS, "scheduler.schedule", "scheduler.finish", "kv_load.*"),
        rules=((_not_loading, "no instance loads KV from another (no kv_consumer / kv_both scheduler)"),),
        applied=("kv_load.invalid_blocks",),
        side="scheduler config of an instance that loads KV (kv_consumer / kv_both)",
    ),
    KV_NEVER_CROSSED: ClassSpec(
        feeds=(("sched.config", {"kv_role": "kv_consumer"}), ("sched.config", {"kv_role": "kv_both"})),
        # (nixl.lease_expired: P's lease running out, the expired-lease rule; optional, 0.32+)
        hooks=(*_SCHED_HOOKS, "scheduler.add_request", "scheduler.allocate_slots", "scheduler.finish",
               "nixl.lease_expired"),
        rules=((_not_loading, "no instance loads KV from another (no kv_consumer / kv_both scheduler)"),),
        side="scheduler config of an instance that loads KV (kv_consumer / kv_both)",
        partial=(("nixl.lease_expired", "its expired-lease rule did not run: this trace does not record P's lease "
                                        "expiry (nixl.lease_expired, from P's worker on vLLM 0.32+; a trace "
                                        "recorded by an older pdtrace, or without P's worker, lacks it)"),),
        one_side=("only D's side is in the trace: a request whose transfer params were dropped cannot be told "
                  "from one sent to D alone without P's trace (record both, pdtrace merge P.jsonl D.jsonl); "
                  "loads that fell short of what P computed are still reported"),
    ),
    KV_INVARIANT: ClassSpec(
        # every scheduler's steps: the invariant holds for any KV cache, with or without P/D or a drafter
        feeds=(("sched.step", {}),),
        needs=("sched.alloc", "sched.config"),
        # (the hooks every other KV class already needs; the drafter's write window is the drafter-window class's
        # hooks, whose coverage that class reports)
        hooks=(*_SCHED_HOOKS, "scheduler.schedule", "scheduler.allocate_slots", "scheduler.add_request",
               "scheduler.finish", "nixl.request_finished*", "nixl.remote_alloc", "nixl.read", "nixl.<import>",
               "kv_load.*"),
        side="sched.step events (engine core)",
    ),
}


@dataclasses.dataclass
class Coverage:
    kind: str
    status: str  # checked | not-applicable | not-checked
    reason: str  # why (empty for a plain "checked")
    events: int  # events that feed the class
    hook_errors: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def decided(self) -> bool:
        return self.status != NOT_CHECKED

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        """``checked (n events)`` / ``does not apply: why`` / ``not checked: why``. A class fed by scheduler configs
        alone (the KV-load classes) says no count: its count is of the schedulers that load KV, and "checked (1
        event(s))" read as if one event had been checked."""
        if self.status == CHECKED:
            spec = CLASSES.get(self.kind)
            configs_only = spec is not None and all(k == "sched.config" for k, _ in spec.feeds)
            return ("checked" if configs_only else f"checked ({self.events} event(s))") + (
                f"; {self.reason}" if self.reason else "")
        if self.status == NOT_APPLICABLE:
            return f"does not apply: {self.reason}"
        return f"not checked: {self.reason}"


@dataclasses.dataclass
class _Facts:
    errors: dict[str, int]  # hook -> exceptions swallowed
    messages: dict[str, str]  # hook -> first error text
    skipped: dict[str, str]  # hook -> why it was not applied
    dropped: dict[Any, int]  # pid -> events dropped
    configs: list[Event]
    runners: set[Any]
    runner_procs: dict[str, set]  # runner -> {"inst pid N"} of the workers that named it
    runner_pids: dict[str, set]  # runner -> pids of the workers whose ``runner`` event named it
    applied: set  # hooks some process applied (hooks.status, the footer)


def _facts(idx: Any, footer: dict | None) -> _Facts:
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}
    seen_events: dict[str, int] = {}
    for e in idx.kind("hook.error"):
        h = str(e.get("hook"))
        seen_events[h] = seen_events.get(h, 0) + 1
        messages.setdefault(h, str(e.get("error", "")))
    exits: dict[str, int] = {}
    dropped: dict[Any, int] = {}
    for e in idx.kind("proc.exit"):
        for h, c in (e.get("hook_errors") or {}).items():
            exits[h] = exits.get(h, 0) + int(c or 0)
        if e.get("dropped"):
            dropped[e.get("pid")] = dropped.get(e.get("pid"), 0) + int(e["dropped"])
    foot = (footer or {}).get("hook_errors") or {}
    for h in set(seen_events) | set(exits) | set(foot):
        errors[h] = max(seen_events.get(h, 0), exits.get(h, 0), int(foot.get(h) or 0))
    for p in (footer or {}).get("processes") or ():
        if p.get("dropped"):
            dropped[p.get("pid")] = max(dropped.get(p.get("pid"), 0), int(p["dropped"]))
    skipped = dict(((footer or {}).get("hooks") or {}).get("skipped") or {})
    applied = set(((footer or {}).get("hooks") or {}).get("applied") or ())
    for e in idx.kind("hooks.status"):
        for h, why in (e.get("skipped") or {}).items():
            skipped.setdefault(h, why)
        for h in e.get("applied") or ():
            skipped.pop(h, None)
            applied.add(h)
    runners = set(idx.runner_values())
    runners.discard(None)
    procs: dict[str, set] = {}
    pids: dict[str, set] = {}
    for e in idx.kind("runner"):
        procs.setdefault(e.get("runner"), set()).add(f"{e.get('inst', '?')} pid {e.get('pid')}")
        pids.setdefault(e.get("runner"), set()).add(e.get("pid"))
    return _Facts(errors, messages, skipped, dropped, list(idx.kind("sched.config")), runners, procs, pids, applied)


def _runner_verdicts(spec: ClassSpec, idx: Any, facts: _Facts) -> tuple[dict[str, str], str]:
    """({runner: why the class does not apply on it}, "model runner V2 ran (...); ..." or "")."""
    na: dict[str, str] = {}
    parts = []
    for r in sorted(facts.runners, key=str):
        who = facts.runner_procs.get(r)
        where = f" ({', '.join(sorted(who))})" if who else ""
        rname = RUNNER_NAMES.get(r, f"model runner {r}")
        if r in spec.runners:
            na[r] = spec.runners[r]
        elif r in spec.na_when:
            kind, why = spec.na_when[r]
            seen = idx.pids(kind)
            need = facts.runner_pids.get(r) or set()
            lacking = need - seen
            if seen and not lacking:
                na[r] = why
            else:
                pids = f" (pid {', '.join(str(p) for p in sorted(lacking, key=str))})" if lacking else ""
                parts.append(f"{rname} ran{where} without the {kind} event that rules this class out there{pids}")
        elif r in spec.unhooked:
            parts.append(f"{rname} ran{where}; pdtrace has no hooks for {spec.unhooked[r]} there")
    return na, "; ".join(parts)


def _matches(hook: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(hook, p) for p in patterns)


def matching(evs: list[Event], filt: dict[str, Any]) -> list[Event]:
    """The events of ``evs`` whose fields have the values ``filt`` names (a feed's filter)."""
    if not filt:
        return evs
    return [e for e in evs if all(e.get(k) == v for k, v in filt.items())]


class IndexFacts:
    """What ``coverage`` reads of a trace, from a loaded trace's ``Index``; a stream gathers
    the same as it reads (``pdtrace.detectors.stream.Summary``). ``kind`` is asked only for
    the small kinds of ``WHOLE_KINDS``."""

    def __init__(self, idx: Any):
        self.idx = idx
        self.kind = idx.kind

    def runner_values(self) -> set:
        out: set = set()
        for k in RUNNER_KINDS:  # C-level pass: a set of the values, usually {None}
            out.update(map(dict.get, self.idx.kind(k), repeat("runner")))
        return out

    def pids(self, kind: str) -> set:
        return set(map(dict.get, self.idx.kind(kind), repeat("pid")))

    def count(self, kind: str, filt: dict[str, Any]) -> tuple[int, set]:
        evs = matching(self.idx.kind(kind), filt)
        return len(evs), set(map(dict.get, evs, repeat("pid")))

    def has(self, kind: str) -> bool:
        return bool(self.idx.kind(kind))


WHOLE_KINDS = ("hook.error", "proc.exit", "hooks.status", "runner", "sched.config")


def _one(kind: str, spec: ClassSpec, idx: Any, facts: _Facts, incomplete: str | None = None) -> Coverage:
    n = 0
    pids: set = set()
    for k, filt in spec.feeds:
        c, ps = idx.count(k, filt)
        n += c
        pids |= ps
    errs = {h: c for h, c in facts.errors.items() if c and _matches(h, spec.hooks)}
    if errs:
        h0 = sorted(errs)[0]
        msg = facts.messages.get(h0)
        why = "; ".join(f"hook {h} raised {c} error(s)" for h, c in sorted(errs.items()))
        return Coverage(kind, NOT_CHECKED, why + (f" (first: {msg})" if msg else ""), n, errs)
    lost = {p: c for p, c in facts.dropped.items() if p in pids}
    if lost:
        why = "; ".join(f"pid {p} dropped {c} event(s) (full queue)" for p, c in sorted(lost.items(), key=str))
        return Coverage(kind, NOT_CHECKED, why + ": some of this class's events may be missing", n)
    missing = [k for k in spec.needs if not idx.has(k)]
    na, unhooked = _runner_verdicts(spec, idx, facts)
    if n and spec.applied and not facts.applied.intersection(spec.applied):
        # a process whose hooks.status is not in the trace (a cut or damaged line) may have applied it
        blind = idx.pids("proc.start") - {e.get("pid") for e in idx.kind("hooks.status")}
        if blind:
            pids = ", ".join(str(p) for p in sorted(blind, key=str)[:6]) + (", ..." if len(blind) > 6 else "")
            why = (f"the trace does not say whether the hook(s) {', '.join(spec.applied)} were applied: "
                   f"{len(blind)} process(es) have no hooks.status event (pid {pids}; its line was cut or damaged, "
                   f"see the trace's problems), and none of the others applied it")
        elif incomplete:  # the hooks.status or footer that would say so may be among what was lost
            return Coverage(kind, NOT_CHECKED, f"the trace is incomplete ({incomplete}) and no event left in it "
                            f"says the hook(s) {', '.join(spec.applied)} were applied: the hooks.status or footer "
                            f"that would may be among what was lost", n)
        else:
            why = (f"recorded without the hook(s) {', '.join(spec.applied)} (none of its processes applied it: "
                   f"recorded before pdtrace had this class, or the hook was skipped): the events that would "
                   f"show this bug cannot be in the trace")
        skipped = {h: r for h, r in facts.skipped.items() if h in spec.applied}
        if skipped:
            why += "; skipped: " + "; ".join(f"{h} ({r})" for h, r in sorted(skipped.items()))
        return Coverage(kind, NOT_CHECKED, why, n)
    if n and not missing and not unhooked:
        note = "; ".join(f"does not apply on {RUNNER_NAMES.get(r, r)}: {why}" for r, why in sorted(na.items()))
        if spec.one_side and not any((c.get("kv_role") or "") in SAVING_ROLES for c in facts.configs):
            return Coverage(kind, NOT_CHECKED, spec.one_side, n)  # its main rule needs the other side
        note = "; ".join([note] * bool(note) + [why for h, why in spec.partial if h not in facts.applied])
        return Coverage(kind, CHECKED, note, n)
    # nothing to decide from: does the recorded configuration rule the bug out?
    if facts.runners and all(r in na for r in facts.runners):
        return Coverage(kind, NOT_APPLICABLE, "; ".join(sorted(set(na.values()))), n)
    sched_failed = any(_matches(h, _SCHED_HOOKS) for h, c in facts.errors.items() if c)
    if facts.configs and not sched_failed:
        for rule, why in spec.rules:
            if all(rule(c) for c in facts.configs):
                return Coverage(kind, NOT_APPLICABLE, f"{why} in all {len(facts.configs)} scheduler config(s)", n)
    if unhooked:  # some of the class's events cannot exist: never clean, even with others present
        return Coverage(kind, NOT_CHECKED, unhooked + (f" ({n} event(s) from other workers)" if n else ""), n)
    if n:
        why = f"no {', '.join(missing)} event(s) to read the {n} {spec.side} against"
    else:
        why = f"the trace has no {spec.side}"
        if not facts.configs:
            why += " and no sched.config"
    skipped = {h: r for h, r in facts.skipped.items() if _matches(h, spec.hooks)}
    if skipped:
        why += "; hook(s) skipped: " + "; ".join(f"{h} ({r})" for h, r in sorted(skipped.items()))
    return Coverage(kind, NOT_CHECKED, why, n)


def coverage(events: list[Event], header: dict | None = None, footer: dict | None = None,
             kinds: tuple[str, ...] | list[str] = (), incomplete: str | None = None) -> dict[str, Coverage]:
    """Per bug class (all of ``CLASSES``, or ``kinds``): a ``Coverage`` for this trace.

    ``incomplete``: why the trace as read is not whole (damaged lines skipped by --lenient, no
    footer), from the loader. Then no class is called checked: the missing part may hold the
    events that would give a finding; nor "does not apply": the configs read may not be all (a
    trace cut at 90 of 160 lines said the stale-read class did not apply, from P's and D's first
    configs, where the whole trace has 17 findings of it after a later D config)."""
    from .kv_invariant import judged  # (what the invariant could judge is its stream's: one pass over the events)

    notes = judged(events) if not kinds or KV_INVARIANT in kinds else None
    return coverage_of(IndexFacts(build(events)), footer, kinds, incomplete, notes=notes)


def coverage_of(idx: Any, footer: dict | None = None, kinds: tuple[str, ...] | list[str] = (),
                incomplete: str | None = None, notes: dict[str, list] | None = None) -> dict[str, Coverage]:
    """``coverage`` from what was gathered of the trace (an ``IndexFacts`` or a stream's
    ``Summary``); ``notes``: the detectors' facts (``Stream.notes``), of which the KV invariant's say which reads
    it could not judge (``kv_invariant.coverage``)."""
    facts = _facts(idx, footer)
    out = {k: _one(k, spec, idx, facts, incomplete) for k, spec in CLASSES.items() if not kinds or k in kinds}
    if notes:
        from .kv_invariant import coverage as with_judged

        out = with_judged(out, notes)
    if incomplete:
        for k, c in out.items():
            if c.status == CHECKED:
                out[k] = Coverage(k, NOT_CHECKED, f"checked only as far as the trace goes: it is incomplete "
                                  f"({incomplete}), events of this class past that may be missing ({c.events} read; "
                                  f"its findings in what was read stand)", c.events, c.hook_errors)
            elif c.status == NOT_APPLICABLE:  # the configs read rule it out; a lost one (another scheduler,
                # another worker: a merged or multi-scheduler trace) may not
                out[k] = Coverage(k, NOT_CHECKED, f"the trace is incomplete ({incomplete}): what it still holds says "
                                  f"it does not apply ({c.reason}), but a scheduler config or worker lost with the "
                                  f"rest may say otherwise", c.events, c.hook_errors)
    return out


def not_checked(cov: dict[str, Coverage]) -> list[str]:
    return [k for k, c in cov.items() if c.status == NOT_CHECKED]
