"""The Accepted counts pane's model: each CPU read of num_accepted_tokens at a step, with
the D2H copy it read from and the InputBatch row owners replayed from batch.* events.
No Textual imports; ``viewers.tui.model`` re-exports these names."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdtrace.index.trace_index import KIND_CODE, TraceIndex

ACC_KINDS = ("d2h.issue", "d2h.done", "acc.read", "acc.truth")
BATCH_KINDS = ("batch.add", "batch.remove", "batch.swap", "batch.condense")


@dataclasses.dataclass
class AccRow:
    row: int
    req: str  # request the read was for
    value: int
    truth: int | None
    owner_at_issue: str | None  # d2h.issue rows[row]
    owner_now: str | None  # from batch.* replay at the read
    issue_t: int | None
    done_t: int | None
    read_t: int
    event_done: bool | None
    synced: bool | None
    status: str  # ok, or a comma list of: stale, wrong-row, wrong-value
    event_ids: list[int]
    history: list[tuple[int, str]]  # (step, owner) changes of this row up to the read
    finding: Any = None  # the stale-read finding on this read, once the detectors have run

    @property
    def bad(self) -> bool:
        return self.status != "ok"


@dataclasses.dataclass
class AccView:
    step: int
    inst: str
    rows: list[AccRow]
    owners: dict[int, str]  # row -> owner at the end of the step


class RowTracker:
    """Row owners from batch.add/remove/swap/condense, replayed with per-position checkpoints."""

    def __init__(self, index: TraceIndex, inst: str):
        self.index = index
        ic = index.inst_code.get(inst, -1)
        want = {KIND_CODE[k] for k in BATCH_KINDS}
        kc, ins = index.kinds, index.insts
        self.ords = [i for i in range(len(kc)) if kc[i] in want and ins[i] == ic]
        self._check: dict[int, tuple[dict[int, str], list[tuple[int, int, str]]]] = {0: ({}, [])}
        self._ic = ic
        self._issues: tuple[dict[str, dict], dict[str, dict]] | None = None

    def issue_maps(self) -> tuple[dict[str, dict], dict[str, dict]]:
        """(CUDA event id -> d2h.issue, -> d2h.done) on this instance, parsed once."""
        if self._issues is None:
            ci, cd = KIND_CODE["d2h.issue"], KIND_CODE["d2h.done"]
            issues: dict[str, dict] = {}
            dones: dict[str, dict] = {}
            kc, ins = self.index.kinds, self.index.insts
            for i in range(len(kc)):
                if ins[i] == self._ic and kc[i] in (ci, cd):
                    e = self.index.event(i)
                    (issues if kc[i] == ci else dones)[e["event"]] = e
            self._issues = (issues, dones)
        return self._issues

    def state_before(self, ordinal: int) -> tuple[dict[int, str], list[tuple[int, int, str]]]:
        """(row -> owner, [(row, step, owner) changes]) after every batch event before ``ordinal``."""
        import bisect

        n = bisect.bisect_left(self.ords, ordinal)
        start = max(k for k in self._check if k <= n)
        rows, hist = self._check[start]
        rows, hist = dict(rows), list(hist)
        for i in self.ords[start:n]:
            e = self.index.event(i)
            k, s = e["ev"], self.index.steps[i]
            if k == "batch.add":
                rows[e["row"]] = e.get("req") or "?"
                hist.append((e["row"], s, rows[e["row"]]))
            elif k == "batch.remove":
                if e["row"] >= 0:
                    rows.pop(e["row"], None)
                    hist.append((e["row"], s, ""))
            elif k == "batch.swap":
                a, b = rows.get(e["i1"], ""), rows.get(e["i2"], "")
                rows[e["i1"]], rows[e["i2"]] = b, a
                hist.append((e["i1"], s, b))
                hist.append((e["i2"], s, a))
            elif k == "batch.condense":
                for mv in e.get("moves") or []:
                    rq, old, new = mv[0], mv[1], mv[2]
                    rows.pop(old, None)
                    rows[new] = rq
                    hist.append((old, s, ""))
                    hist.append((new, s, rq))
        self._check[n] = (dict(rows), list(hist))
        return rows, hist


def acc_insts(index: TraceIndex) -> list[str]:
    code = KIND_CODE["acc.read"]
    return [name for ic, name in enumerate(index.inst_names) if (ic, code) in index.first_of_kind]


# the stale-read detector's reasons, as this pane's status tags
_REASON_TAG = {"row-moved": "wrong-row", "copy-not-complete": "stale", "landing-unknown": "inconclusive"}


def _verdicts(findings: list[Any]) -> dict[tuple, tuple[list[str], Any]]:
    """(inst, req, step, row) -> (status tags, the finding) of the stale-read findings."""
    out: dict[tuple, tuple[list[str], Any]] = {}
    for f in findings:
        if f.kind != "stale-accepted-count-read":
            continue
        tags = [_REASON_TAG.get(r, r) for r in f.data.get("reasons", ())]
        if f.severity == "error":
            tags.append("wrong-value")
        out[(f.inst, f.req, f.step, f.data.get("row"))] = (tags, f)
    return out


def accepted(index: TraceIndex, step: int | None, trackers: dict[str, RowTracker] | None = None,
             findings: list[Any] | None = None) -> list[AccView]:
    """The reads at ``step``. With ``findings`` (the detectors have run), each read's verdict
    is the stale-read detector's (it replays where each copy landed among the row moves); without,
    a first look from the rows at copy time and the truth, until the detectors' findings arrive."""
    if step is None:
        return []
    verdicts = _verdicts(findings) if findings is not None else None
    trackers = trackers if trackers is not None else {}
    views = []
    for inst in acc_insts(index):
        ords = index.step_ordinals(step, inst, ACC_KINDS)
        reads = [i for i in ords if index.kind(i) == "acc.read"]
        if not reads:
            continue
        tr = trackers.get(inst)
        if tr is None:
            tr = trackers[inst] = RowTracker(index, inst)
        issues, dones = tr.issue_maps()
        rows = []
        for i in reads:
            e = index.event(i)
            req = e.get("req") or "?"
            owners, hist = tr.state_before(i)
            iss = issues.get(e.get("event")) if e.get("event") else None
            done = dones.get(e.get("event")) if e.get("event") else None
            at_issue = None
            if iss is not None:
                rr = iss.get("rows") or []
                at_issue = rr[e["row"]] if 0 <= e["row"] < len(rr) else ""
            truth_ev = _truth(index, req, step)
            truth = truth_ev["value"] if truth_ev else None
            found = None
            if verdicts is not None:
                bad, found = verdicts.get((inst, req, step, e["row"]), ([], None))
            else:
                bad = []
                if e.get("event_done") is False and not e.get("synced"):
                    bad.append("stale")
                if (at_issue is not None and at_issue != req) or owners.get(e["row"], req) != req:
                    bad.append("wrong-row")
                if truth is not None and e["value"] != truth:
                    bad.append("wrong-value")
            status = ",".join(bad) or "ok"
            ids = [e["id"]] + [x["id"] for x in (iss, done, truth_ev) if x]
            rows.append(AccRow(e["row"], req, e["value"], truth, at_issue, owners.get(e["row"]),
                               iss["t"] if iss else None, done["t"] if done else None, e["t"],
                               e.get("event_done"), e.get("synced"), status, ids,
                               [(s, o) for (r, s, o) in hist if r == e["row"]][-6:], found))
        end = max(ords) + 1 if ords else 0
        owners_end, _ = tr.state_before(end)
        views.append(AccView(step, inst, rows, owners_end))
    return views


def _truth(index: TraceIndex, req: str, step: int) -> dict[str, Any] | None:
    best = None
    for i in index.request_ordinals(req, ["acc.truth"]):
        e = index.event(i)
        fs = e.get("for_step")
        if fs == step - 1:
            return e
        if fs is not None and fs <= step and (best is None or fs > best["for_step"]):
            best = e
    return best


