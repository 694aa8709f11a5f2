"""`pdtrace report` on a trace too big to hold (issue 22): two passes over the file, memory
bounded by what the page can show, not by the trace.

Pass 1 is the streamed check (``pdtrace.detectors.stream.run``): the findings and the
coverage facts, and, through its ``observe`` hook, the page's totals (``Totals``): the time
range, events per kind, per lane and kind for the figures that count them, each worker's
connector-metadata steps, the P/D request pairs and the order of the KV transfers.

Pass 2 reads the file again and keeps (``Keep``):

- every event near a finding (``Model.near_finding``: the affected requests and their P/D
  pairs, the steps findings name, 64 ids either side of a cited event): at most
  ``NEAR_KEPT`` of them, and every cited event;
- the first ``OPENING`` events (the event table fills up with the earliest ones; a trace
  that small is kept whole, and the timeline draws every event as it would);
- per lane, the first ``STEPS_KEPT`` engine steps and the step after each near one (the
  timeline's bars end at the next step);
- the events of the first ``KV_KEPT`` KV transfers without a finding (the timeline's lines);
- per worker, the first ``ACC_KEPT`` accepted-count / batch events and those within
  ``STALE_RADIUS`` steps of a stale read;
- per worker, the connector-metadata events of its first ``META_STEPS`` steps and of the
  steps around a metadata finding (of a worker that records no steps: the first
  ``META_NOSTEP_KEPT``);
- the configuration and process events (a few per process).

Each figure then chooses among the kept events as it would among all of them (each keeps
at most these many), with the trace's counts from ``Totals``. Every event that is not near
a finding is also counted into ``FINE_BINS`` time bins per lane and kind, which the
timeline merges into its aggregated markers. No vLLM / torch import here.
"""

from __future__ import annotations

import collections
import gc
from itertools import repeat
from operator import itemgetter
from typing import Any

from pdtrace.detectors import stream
from pdtrace.detectors.coverage import coverage_of, incomplete_reason
from pdtrace.detectors.index import Configs, Index
from pdtrace.tracefile.eventlist import EventList
from pdtrace.tracefile.reading import Sink, read_through

from .common import FindingView, Model, lane

NEAR_KEPT = 200_000
OPENING = 30_000  # >= the event table's cap and the timeline's point budget (report.DEFAULT_*)
STEPS_KEPT = 7_501  # > the timeline's largest step budget (point budget // 4)
KV_KEPT = 200  # the timeline's transfers without a finding
ACC_KEPT = 7_500  # the accepted-count figure's largest budget
STALE_RADIUS = 16  # steps kept around a stale read (the figure draws +-3 around the steps it cites)
META_STEPS = 50  # the metadata figure's largest step count
META_RADIUS = 2
META_NOSTEP_KEPT = 20_000  # per worker, connector-metadata events without a step (the figure draws them all)
FINE_BINS = 4_000

ACC_KINDS = ("d2h.issue", "d2h.done", "acc.read", "acc.truth", "batch.add", "batch.remove", "batch.swap",
             "batch.condense")
META_KINDS = ("kvmeta.bind", "kvmeta.clear", "kvmeta.has", "kvmeta.save_layer", "kvmeta.wait_for_save", "spec.phase")
ALWAYS = frozenset({"sched.config", "runner", "proc.start", "proc.exit", "proc.role", "hooks.status",
                    "kvload.handled", "kvload.request", "kvload.error", "kvload.reported"})  # (rare: failures)
KV_KINDS = frozenset({"nixl.read", "nixl.read_done", "nixl.request_finished"})
_W = itemgetter("w")


class Totals:
    """What pass 1 counts for the page (``observe`` of the streamed check)."""

    def __init__(self) -> None:
        self.n = 0
        self.t_lo: int = 0
        self.t_hi: int = 0
        self.kinds: collections.Counter = collections.Counter()
        self.lane_kind: collections.Counter = collections.Counter()  # (lane, kind): steps, accepted kinds
        self.meta_steps: dict[str, list] = {}  # lane -> [last step, distinct steps]
        self.d2p: dict[str, str] = {}
        self.reads: dict[str, None] = {}  # D requests in the order of their first nixl.read
        self.insts: set = set()
        self._first = True
        # filled by pass 2 (``read``): the time bins of the events not near a finding, and every lane
        self.bins: collections.Counter = collections.Counter()
        self.lanes: set[str] = set()

    def __call__(self, idx: Index) -> None:
        evs = idx.events
        if not evs:
            return
        self.n += len(evs)
        ws = list(map(_W, evs))
        lo, hi = min(ws), max(ws)
        if self._first:
            self.t_lo, self.t_hi, self._first = lo, hi, False
        else:
            self.t_lo, self.t_hi = min(self.t_lo, lo), max(self.t_hi, hi)
        for k, lst in idx.by_kind.items():
            if lst:
                self.kinds[k] += len(lst)
        self.insts.update(map(dict.get, evs, repeat("inst"), repeat("-")))
        for k in ("sched.step", *ACC_KINDS):
            for e in idx.kind(k):
                self.lane_kind[(lane(e), k)] += 1
        meta = [e for k in META_KINDS for e in idx.kind(k)]
        if meta:
            meta.sort(key=itemgetter("id"))
            for e in meta:
                if "step" in e:
                    st = self.meta_steps.setdefault(lane(e), [None, set()])
                    if e["step"] != st[0]:
                        st[0] = e["step"]
                        st[1].add(e["step"])
        pairs = [*idx.kind("req.add"), *idx.kind("nixl.remote_alloc"), *idx.kind("nixl.read")]
        pairs.sort(key=itemgetter("id"))
        for e in pairs:  # Model's rule, in trace order
            if "req" not in e:
                continue
            if e["ev"] == "req.add":
                kv = e.get("kv")
                if isinstance(kv, dict) and kv.get("remote_request_id"):
                    self.d2p[e["req"]] = str(kv["remote_request_id"])
            elif e.get("remote_req"):
                self.d2p.setdefault(e["req"], str(e["remote_req"]))
            if e["ev"] == "nixl.read":
                self.reads.setdefault(e["req"], None)

    def steps(self, ln: str) -> int:
        return self.lane_kind.get((ln, "sched.step"), 0)

    def meta_step_count(self, ln: str) -> int:
        st = self.meta_steps.get(ln)
        return len(st[1]) if st else 0

    def lane_total(self, ln: str, kinds: tuple[str, ...]) -> int:
        return sum(self.lane_kind.get((ln, k), 0) for k in kinds)


class Keep:
    """Pass 2: the events the page can use, and the time bins of the rest."""

    def __init__(self, m: Model, totals: Totals):
        self.m, self.totals = m, totals
        self.kept = EventList()
        self.n_near = 0
        self.bins: collections.Counter = collections.Counter()  # (lane, fine bin, kind)
        self.lanes: set[str] = set()
        self.cited = set(m.finding_ids)
        self._j = 0
        self._lane_of: dict[tuple, str] = {}
        self._steps: collections.Counter = collections.Counter()
        self._next_step: set[str] = set()
        self._acc: collections.Counter = collections.Counter()
        self._meta_first: dict[str, set] = {}
        self._meta_nostep: collections.Counter = collections.Counter()
        stale = [f for f in m.findings if f.kind == "stale-accepted-count-read" and f.step is not None]
        self._stale = {(f.inst, f.step + d) for f in stale for d in range(-STALE_RADIUS, STALE_RADIUS + 1)}
        meta = [f for f in m.findings if f.kind == "connector-metadata-cleared-before-drafter" and f.step is not None]
        self._meta_find = {(f.inst, f.step + d) for f in meta for d in range(-META_RADIUS, META_RADIUS + 1)}
        kv_reqs: list[str] = []
        for dreq in totals.reads:
            if dreq in m.affected_reqs or m.d2p.get(dreq) in m.affected_reqs:
                continue
            kv_reqs.append(dreq)
            if len(kv_reqs) >= KV_KEPT:
                break
        self._kv = set(kv_reqs) | {m.d2p.get(r, r) for r in kv_reqs}
        self._kvload: set[tuple] = set()  # (inst, req) a failed KV load touched
        span = max(totals.t_hi - totals.t_lo, 1)
        self._scale = FINE_BINS / span

    def __call__(self, seg: list[dict[str, Any]]) -> None:
        m, keep = self.m, self.kept.append
        aff, fsteps, cited_ids = m.affected_reqs, m.finding_steps, m.finding_ids
        t_lo, scale, bins, lanes = self.totals.t_lo, self._scale, self.bins, self._lane_of
        j = self._j  # events come in id order: the first cited id not yet 64 ids behind
        for e in seg:
            k = e["ev"]
            eid = e.get("id", -1)
            key = (e["pid"], e["role"])  # a process's lane changes only with its role
            ln = lanes.get(key)
            if ln is None:
                ln = lanes[key] = lane(e)
            # Model.near_finding, with the cited ids walked in order instead of bisected
            if j and cited_ids[j - 1] >= eid - 64:  # (ids out of order: a hand-edited file) walk again
                j = 0
            while j < len(cited_ids) and cited_ids[j] < eid - 64:
                j += 1
            near = (e.get("req") in aff or (e.get("inst"), e.get("step")) in fsteps
                    or (j < len(cited_ids) and cited_ids[j] - eid <= 64))
            if near and (self.n_near < NEAR_KEPT or eid in self.cited):
                self.n_near += 1
                keep(e)
                if k == "sched.step":
                    self._next_step.add(ln)
                continue
            if k != "sched.step":
                b = int((e["w"] - t_lo) * scale)
                bins[(ln, b if b < FINE_BINS else FINE_BINS - 1, k)] += 1
            else:
                self.lanes.add(ln)
            if self._wanted(e, k, ln, eid):
                keep(e)
        self._j = j

    def _wanted(self, e: dict[str, Any], k: str, ln: str, eid: int) -> bool:
        if eid < OPENING or k in ALWAYS:
            if k == "kvload.request":  # its finish is kept too (the recovery row ends there)
                self._kvload.add((e.get("inst"), e.get("req")))
            return True
        if k == "req.finish":
            return (e.get("inst"), e.get("req")) in self._kvload
        if k == "sched.step":
            self._steps[ln] += 1
            if ln in self._next_step:
                self._next_step.discard(ln)
                return True
            return self._steps[ln] <= STEPS_KEPT
        if k in KV_KINDS:
            return e.get("req") in self._kv
        if k in ACC_KINDS:
            self._acc[ln] += 1
            return self._acc[ln] <= ACC_KEPT or (e.get("inst"), e.get("step")) in self._stale
        if k in META_KINDS and "step" not in e:  # a worker that does not know its step: drawn in order
            self._meta_nostep[ln] += 1
            return self._meta_nostep[ln] <= META_NOSTEP_KEPT
        if k in META_KINDS:
            first = self._meta_first.setdefault(ln, set())
            s = e["step"]
            if s in first or len(first) < META_STEPS:
                first.add(s)
                return True
            return (e.get("inst"), s) in self._meta_find
        return False


class ReducedTrace:
    """What ``render`` reads of a trace (``pdtrace.tracefile.trace.Trace``'s fields), for a trace read in
    two passes: ``events`` are the kept ones; ``totals`` (with pass 2's time bins) and
    ``coverage`` are the trace's."""

    def __init__(self, path: str, res: Any, totals: Totals, keep: Keep, coverage: dict[str, Any]):
        self.path = path
        self.header, self.footer, self.problems = res.header, res.footer, res.problems
        self.events = keep.kept
        self.totals = totals
        self.n_events = res.n_events
        self.coverage = coverage
        self.notes = res.notes  # the detectors' facts over the whole trace (pass 1): e.g. where prompt tokens came from


class _Pass(Sink):
    """A second pass's header / footer / problems, and what it keeps."""

    def __init__(self, keep: Keep):
        super().__init__()
        self.keep = keep


def _second_pass(path: str, lenient: bool, keep_of: Any) -> Keep:
    def start(_fast: bool) -> tuple[_Pass, Any]:
        keep, configs, held = keep_of(), Configs(), {}
        sink = _Pass(keep)

        def consume(seg: Any) -> None:
            idx = Index(seg, configs)
            configs.add(idx.kind("sched.config"))
            if sink.header.get("schema_version", 1) >= 2:  # schema v2 block lists, as the check derives them
                stream._derive_segment(idx, getattr(seg, "blocks_derived", False), held)
            keep(seg)
        return sink, consume
    return read_through(path, lenient, None, start).keep


def read(path: str, *, lenient: bool = False, progress: Any = None) -> tuple[ReducedTrace, list, dict]:
    """(the reduced trace, the findings, the coverage) of the trace at ``path``."""
    res = stream.run(path, lenient=lenient, progress=progress, observe=Totals)
    totals: Totals = res.observed
    cov = coverage_of(res.summary, res.footer, incomplete=incomplete_reason(res.footer, res.problems), notes=res.notes)
    fv = [FindingView.of(f) for f in res.findings]
    m = Model([], fv, totals=totals)
    was_enabled = gc.isenabled()
    gc.disable()  # events hold no cycles: the cyclic GC would rescan the kept ones at every segment
    try:
        keep = _second_pass(path, lenient, lambda: Keep(m, totals))
    finally:
        if was_enabled:
            gc.enable()
    totals.bins, totals.lanes = keep.bins, keep.lanes | {lane(e) for e in keep.kept}
    return ReducedTrace(path, res, totals, keep, cov), res.findings, cov
