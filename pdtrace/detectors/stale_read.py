"""stale-accepted-count-read (vLLM thread 004).

Async spec decode copies ``num_accepted_tokens`` GPU->CPU with a non-blocking copy and
records a CUDA event. ``_prepare_inputs`` then reads the CPU copy per InputBatch row. The
read is stale when (a) the row it reads held another request when the copy was issued
(``swap_states`` / ``condense`` moved rows in between), or (b) the copy's event had not
completed and the runner did not synchronize.

Per worker process, events are replayed in trace order: ``d2h.issue`` (rows at issue
time), ``d2h.done``, ``batch.*`` (row moves, kept as history), ``acc.read``, ``acc.truth``.
A wrong value (differs from ``acc.truth``) is an error; a race whose value happened to be
right is a warning. A read is judged only against a copy that covered its row: a row past
the copy's rows that ``batch.add`` gave the reading request after the copy holds the value
``InputBatch.add_request`` set, not a stale one. ``swap_states`` and ``condense`` move
``num_accepted_tokens_cpu`` with their rows (vLLM 0.32.0 ``v1/worker/gpu_input_batch.py``), so
a copy known complete before every row change after it (a ``blocking`` copy, as on CPU, or
an observed ``d2h.done``) follows its requests: a read of the row the moves carried the
request's value to is right.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import eq, itemgetter
from typing import Any

from .base import SEVERITY_ERROR, SEVERITY_WARNING, STALE_ACCEPTED_COUNT_READ, Finding
from .index import feed_all, kind_code

Event = dict[str, Any]

_pid = itemgetter("pid")
_row = itemgetter("row")
_req = itemgetter("req")
_pid_event_done = itemgetter("pid", "event", "event_done")
_KINDS = ("d2h.issue", "d2h.done", "acc.read", "batch.add", "batch.remove", "batch.swap", "batch.condense")


def _truth_for(truths: list[Event], read: Event) -> Event | None:
    step = read.get("step")
    if not truths:
        return None
    if step is not None:
        for t in truths:
            if t.get("step") == step:
                return t
        for t in truths:
            if t.get("for_step") == step - 1:
                return t
    best = None
    for t in truths:
        if t["id"] < read["id"]:
            best = t
    return best


# Bounds on the history kept per worker process (a stream keeps these, not the trace): the
# latest copies a read can name, and the completions / row moves after the oldest of them.
MAX_ISSUES = 1024
MAX_DONE = 4096
MAX_MOVES_NO_ISSUE = 65536
TRUTHS_KEPT = 16384  # the latest acc.truth events kept, for a stale read found later
TRUTHS_PER_READ = 4096  # acc.truth events kept per stale read's request


class Stream:
    """The detector over events fed in trace order (``feed`` one ``Index`` of consecutive
    events at a time, then ``finish``). It keeps, per worker process, the latest
    ``MAX_ISSUES`` D2H copies, their completions, the row moves since the oldest of them, and
    the rows' latest ``batch.add``; the latest ``TRUTHS_KEPT`` ``acc.truth`` events; and the
    stale reads found, each with the truths of its request from those kept on."""

    KINDS = (*_KINDS, "acc.truth")  # (what it reads)

    def __init__(self, header: dict | None = None):
        self.issues: dict[Any, dict[str, Event]] = {}  # pid -> event id -> d2h.issue
        self.last_issue: dict[Any, Event] = {}
        self.done: dict[Any, dict[str, None]] = {}  # pid -> copy events known complete
        self.done_at: dict[Any, dict[str, int]] = {}  # pid -> copy event -> trace id when known complete
        self.moves: dict[Any, list[Event]] = {}  # pid -> batch events in order (row history)
        self.added: dict[Any, dict[int, Event]] = {}  # pid -> row -> its latest batch.add
        self.stale: list[tuple] = []  # the stale reads, one per dedup key, in trace order
        self.seen: dict[tuple, list] = {}  # dedup key -> ranks of that read
        self.recent: deque[Event] = deque(maxlen=TRUTHS_KEPT)  # the latest acc.truth events
        self.truths: dict[tuple, list[Event]] = {}  # (inst, req) of a stale read -> its truths

    def feed(self, idx: Any) -> None:
        self._replay(idx)
        self._truths(idx)
        self._prune()

    def _replay(self, idx: Any) -> None:
        if not any(idx.kind(k) for k in _KINDS):
            return
        issues, last_issue, done, done_at = self.issues, self.last_issue, self.done, self.done_at
        moves, added, stale, seen = self.moves, self.added, self.stale, self.seen
        READ, ISSUE, DONE = kind_code("acc.read"), kind_code("d2h.issue"), kind_code("d2h.done")
        no_issues: dict[str, Event] = {}
        seq, codes = idx.ordered_codes(_KINDS)
        # Reads come in runs between the state changes (issues, completions, row moves): a run
        # whose reads all agree with the issue they read is cleared at once by C-level passes;
        # any other run goes through the exact per-read check.
        not_read = codes.translate(bytes(c != READ for c in range(256)))
        i, n = 0, len(seq)
        while i < n:
            if not_read[i]:
                e = seq[i]
                code = codes[i]
                if code == ISSUE:
                    issues.setdefault(e["pid"], {})[e["event"]] = e
                    last_issue[e["pid"]] = e
                    if e.get("blocking") is True:
                        done_at.setdefault(e["pid"], {})[e["event"]] = e["id"]
                elif code == DONE:
                    done.setdefault(e["pid"], {})[e["event"]] = None
                    done_at.setdefault(e["pid"], {}).setdefault(e["event"], e["id"])
                else:  # batch.*
                    moves.setdefault(e["pid"], []).append(e)
                    if e["ev"] == "batch.add":
                        added.setdefault(e["pid"], {})[e["row"]] = e
                i += 1
                continue
            j = not_read.find(1, i)
            if j < 0:
                j = n
            run = seq[i:j]
            i = j
            if _run_clean(run, issues, last_issue):
                continue
            for e in run:
                pid = e["pid"]
                ev_id = e.get("event")
                issue = issues.get(pid, no_issues).get(ev_id) if ev_id is not None else None
                if issue is None:
                    issue = last_issue.get(pid)
                # the common read: its row held the request at issue time, and the copy was done
                row = e["row"]
                req = e.get("req")
                if issue is not None:
                    rows = issue["rows"]
                    moved = (rows[row] if 0 <= row < len(rows) else None) != req
                else:
                    moved = False
                if not moved and (e.get("event_done") is not False or e.get("synced") is True
                                  or (ev_id is not None and ev_id in done.get(pid, ()))):
                    continue
                if issue is not None and not 0 <= row < len(issue["rows"]):
                    fresh = added.get(pid, {}).get(row)
                    if fresh is not None and fresh.get("req") == req and fresh["id"] > issue["id"]:
                        continue  # the copy never wrote this row: it holds what add_request set
                if moved and issue is not None:
                    complete = done_at.get(pid, {}).get(issue["event"])
                    if complete is not None and _followed(moves.get(pid, ()), issue, complete, row, req):
                        continue  # the copy landed before any row change; the changes carried its values
                reasons = []
                row_req_at_issue = None
                if issue is not None:
                    rows = issue["rows"]
                    row_req_at_issue = rows[row] if 0 <= row < len(rows) else None
                    if row_req_at_issue != req:
                        reasons.append("row-moved")
                not_done = e.get("event_done") is False and e.get("synced") is not True
                if not_done and ev_id is not None and ev_id in done.get(pid, ()):
                    not_done = False  # observed complete before the read
                if not_done:
                    reasons.append("copy-not-complete")
                if not reasons:
                    continue
                dkey = (e.get("inst"), req, e.get("step"), row, e["value"])
                if dkey in seen:  # another TP rank read the same thing
                    seen[dkey].append(e.get("rank"))
                    continue
                ranks = seen[dkey] = [e.get("rank")]
                stale.append((e, pid, row, req, ev_id, issue, reasons, row_req_at_issue,
                              _history(moves.get(pid, ()), issue, row, req), ranks))
                key = (e.get("inst"), req)
                if key not in self.truths:  # the truths of it kept so far (those after it follow)
                    self.truths[key] = self._kept_truths(key)

    def _kept_truths(self, key: tuple) -> list[Event]:
        """The kept truths of ``key`` (inst, req): picked by request at C level, then by instance."""
        inst, req = key
        recent = self.recent
        mine = compress(recent, map(eq, map(dict.get, recent, repeat("req")), repeat(req)))
        return [t for t in mine if t.get("inst") == inst]

    def _truths(self, idx: Any) -> None:
        """Give each stale read the truths of its request in this segment (a worker's
        truths may follow the scheduler's end of the request: they are collected to the end
        of the trace, at most ``TRUTHS_PER_READ`` each); then keep the segment's truths among
        the latest."""
        truths = idx.kind("acc.truth")
        wanted = self.truths
        if wanted:
            reqs = {k[1] for k in wanted}
            for t in compress(truths, map(reqs.__contains__, map(dict.get, truths, repeat("req")))):
                lst = wanted.get((t.get("inst"), t.get("req")))
                if lst is not None and len(lst) < TRUTHS_PER_READ and (not lst or lst[-1]["id"] < t["id"]):
                    lst.append(t)
        self.recent.extend(truths)

    def _prune(self) -> None:
        """Trim a process's copies back to ``MAX_ISSUES`` once they pass a quarter more (so
        the work is spread over many segments), with the row moves before the oldest kept
        copy; the completions likewise to ``MAX_DONE``."""
        for pid, iss in self.issues.items():
            if len(iss) <= MAX_ISSUES + MAX_ISSUES // 4:
                continue
            for ev in list(iss)[:len(iss) - MAX_ISSUES]:
                del iss[ev]
            self.issues[pid] = iss = dict(iss)  # (a fresh table: no deleted slots before the oldest)
            oldest = next(iter(iss.values()))["id"]
            mv = self.moves.get(pid)
            if mv and mv[0]["id"] <= oldest:
                self.moves[pid] = [m for m in mv if m["id"] > oldest]
        for table in (self.done, self.done_at):
            for pid, d in table.items():
                if len(d) > MAX_DONE + MAX_DONE // 4:
                    for ev in list(d)[:len(d) - MAX_DONE]:
                        del d[ev]
                    table[pid] = dict(d)
        for pid, mv in self.moves.items():
            if pid not in self.issues and len(mv) > MAX_MOVES_NO_ISSUE + MAX_MOVES_NO_ISSUE // 4:
                del mv[:len(mv) - MAX_MOVES_NO_ISSUE]

    def finish(self) -> list[Finding]:
        truths: dict[tuple, list[Event]] = {}
        for key, lst in self.truths.items():
            if lst:
                truths[key] = sorted(lst, key=_by_id)
        return [_finding(truths, *r) for r in self.stale]


_by_id = itemgetter("id")


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


def _run_clean(run: list[Event], issues: dict[Any, dict[str, Event]], last_issue: dict[Any, Event]) -> bool:
    """True when no read of ``run`` (consecutive reads, no state change between them) is
    stale: one process, one copy event, every row held its reader at issue time, and no read
    saw the copy unfinished. False means "look at each read" (also on anything unusual,
    such as a read without ``req``, ``event`` or ``event_done``)."""
    try:
        heads = list(map(_pid_event_done, run))  # KeyError without event / event_done
        first = heads[0]
        if heads.count(first) != len(heads) or first[2] is False:
            return False
        pid, ev_id, _done = first
        issue = issues.get(pid, {}).get(ev_id) if ev_id is not None else None
        if issue is None:
            issue = last_issue.get(pid)
        if issue is not None:
            rows_read = list(map(_row, run))
            if min(rows_read) < 0:
                return False
            # IndexError past the issue's rows
            return list(map(issue["rows"].__getitem__, rows_read)) == list(map(_req, run))
        return True
    except Exception:  # odd field values: the per-read check raises or decides
        return False


def _followed(pid_moves: Any, issue: Event, complete: int, row: Any, req: Any) -> bool:
    """True when the copy was complete (trace id ``complete``) before every row change after
    it, and replaying those changes (swap, condense, or ``add_request`` giving ``req`` a row,
    which sets the count to 1) puts ``req``'s value in ``row``."""
    rows = issue["rows"]
    r = rows.index(req) if req in rows else None
    lo = issue["id"]
    for m in pid_moves:
        if m["id"] <= lo:
            continue
        mk = m["ev"]
        if mk == "batch.remove":
            continue
        if m["id"] < complete:
            return False  # a row changed while the copy could still land in the old layout
        if mk == "batch.add":
            if m.get("req") == req:
                r = m["row"]
        elif mk == "batch.swap":
            if r == m["i1"]:
                r = m["i2"]
            elif r == m["i2"]:
                r = m["i1"]
        elif mk == "batch.condense":
            for q, old, new in m["moves"]:
                if old == r:
                    r = new
                    break
    return r is not None and r == row


def _history(pid_moves: Any, issue: Event | None, row: Any, req: Any) -> list[dict]:
    """Row history between the issue and the read: moves touching this request or this row."""
    hist = []
    lo = issue["id"] if issue is not None else -1
    for m in pid_moves:
        if m["id"] <= lo:
            continue
        mk = m["ev"]
        if mk == "batch.swap":
            if row in (m["i1"], m["i2"]) or req in (m["req1"], m["req2"]):
                hist.append({"event": m["id"], "op": "swap", "rows": [m["i1"], m["i2"]],
                             "reqs": [m["req1"], m["req2"]]})
        elif mk == "batch.condense":
            mv = [list(x) for x in m["moves"] if x[0] == req or row in (x[1], x[2])]
            if mv:
                hist.append({"event": m["id"], "op": "condense", "moves": mv})
        elif m.get("row") == row or m.get("req") == req:
            hist.append({"event": m["id"], "op": mk.split(".", 1)[1], "row": m.get("row"),
                         "req": m.get("req")})
    return hist


def _finding(truths: dict[tuple, list[Event]], e: Event, pid: Any, row: Any, req: Any, ev_id: Any,
             issue: Event | None, reasons: list[str], row_req_at_issue: Any, hist: list[dict],
             ranks: list) -> Finding:
    truth = _truth_for(truths.get((e.get("inst"), req), []), e)
    tval = truth["value"] if truth is not None else None
    if tval is not None:
        severity = SEVERITY_ERROR if tval != e["value"] else SEVERITY_WARNING
    else:
        severity = SEVERITY_ERROR if "row-moved" in reasons else SEVERITY_WARNING
    issue_row_of_req = None
    if issue is not None and req in issue["rows"]:
        issue_row_of_req = issue["rows"].index(req)
    ids = [x for x in (issue["id"] if issue is not None else None, e["id"],
                       truth["id"] if truth is not None else None) if x is not None]
    ids += [h["event"] for h in hist]
    parts = []
    if "row-moved" in reasons:
        assert issue is not None
        parts.append(
            f"the last D2H copy (event {issue.get('event')!r}, trace event {issue['id']}) was issued when row "
            f"{row} held {row_req_at_issue!r}" + (f" and {req} was in row {issue_row_of_req}" if issue_row_of_req is not None else f" and {req} was in no row")
            + (f"; then {len(hist)} row move(s): " + ", ".join(_fmt_move(h) for h in hist[:6]) if hist else ""))
    if "copy-not-complete" in reasons:
        parts.append(f"the copy's CUDA event {ev_id!r} had not completed (event.query() False) and the "
                     f"runner did not synchronize")
    vtxt = (f"read {e['value']}, authoritative value {tval}" if tval is not None
            else f"read {e['value']} (no acc.truth recorded)")
    title = (f"request {req} step {e.get('step')}: accepted count read from row {row} "
             f"{'is another row' + chr(39) + 's' if 'row-moved' in reasons else 'raced the D2H copy'} ({vtxt})")
    expl = (f"_prepare_inputs read num_accepted_tokens for {req} from row {row} on {e.get('inst')} "
            f"(pid {pid}, step {e.get('step')}), but " + "; and ".join(parts) + f". It {vtxt}. "
            + ("The request used a wrong accepted count (wrong recurrent-state slot / positions)."
               if severity == SEVERITY_ERROR else
               "The value happened to be right, but the read is a race that can return another count."))
    return Finding(
        kind=STALE_ACCEPTED_COUNT_READ, severity=severity, req=req, step=e.get("step"),
        inst=e.get("inst"), event_ids=sorted(set(ids)), title=title, explanation=expl,
        data={"row": row, "value": e["value"], "truth": tval, "reasons": reasons,
              "d2h_event": ev_id if ev_id is not None else (issue or {}).get("event"),
              "event_done": e.get("event_done"), "synced": e.get("synced"),
              "row_req_at_issue": row_req_at_issue, "req_row_at_issue": issue_row_of_req,
              "row_history": hist, "pid": pid, "ranks": ranks})


def _fmt_move(h: dict) -> str:
    if h["op"] == "swap":
        return f"swap rows {h['rows'][0]}<->{h['rows'][1]} ({h['reqs'][0]}<->{h['reqs'][1]})"
    if h["op"] == "condense":
        return "condense " + ", ".join(f"{q} {a}->{b}" for q, a, b in h["moves"])
    return f"{h['op']} {h.get('req')} row {h.get('row')}"
