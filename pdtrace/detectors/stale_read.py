"""stale-accepted-count-read (vLLM thread 004, and the remainder open upstream as #51571).

Async spec decode copies ``num_accepted_tokens`` GPU->CPU with a non-blocking copy and
records a CUDA event. ``_prepare_inputs`` then reads the host buffer per request: under async
scheduling through the request's row of the previous step (``prev_positions``), otherwise its
current row. ``_update_states`` moves InputBatch rows in between (add_request, condense,
swap_states), and those moves rewrite the same buffer.

The detector follows the data (``acc_rows``): per worker process it replays what each buffer
row holds after the copy lands and after every move, with the copy's landing point placed from
the trace (``d2h.done`` before a move, a move's ``landed`` field, a blocking copy). A read is
right when its row holds the reading request's count from the latest copy that covered it (or
add_request's 1 for a request added since). Otherwise:

- another request's count, or a new request's 1, is there: the copy landed before a row move
  that the read's mapping does not follow (vLLM #51571: the copy lands, then add_request /
  condense / swap_states move the values, and the gather through ``prev_positions`` reads the
  old rows), or after moves that a direct read assumed it followed (seed 004, 0.19.0-0.23.0);
- the request's count from an older copy is there: the copy had not landed (no sync);
- the possible landing points disagree about the row: inconclusive, never clean; but an
  unsynchronized read whose value differs from ``acc.truth`` is an error wherever the copy landed
  (on that path the copy carries the authoritative count; align mode's synchronized path copies 1
  by design, so there it stays inconclusive).

Severity compares the value read with the request's own count: the copy's own values
(``d2h.done`` / blocking ``d2h.issue`` ``values``) where recorded, else ``acc.truth`` (in Mamba
align mode the copy carries 1 after a block-boundary state copy, where ``acc.truth`` does not:
a right row read against the copy's values is never a finding). A wrong row whose value is
nevertheless the request's own is a warning; a wrong value an error.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import eq, itemgetter
from typing import Any

from .acc_rows import INITIAL, UNKNOWN, Rows, valid_condense_move
from .base import SEVERITY_ERROR, SEVERITY_INCONCLUSIVE, SEVERITY_WARNING, STALE_ACCEPTED_COUNT_READ, Finding
from .index import feed_all, kind_code

Event = dict[str, Any]

_KINDS = ("d2h.issue", "d2h.done", "acc.read", "batch.add", "batch.remove", "batch.swap", "batch.condense")
UPSTREAM = "vLLM #51571"


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
MAX_LATEST = 65536  # requests whose latest copy a process's buffer remembers
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
        self.moves: dict[Any, list[Event]] = {}  # pid -> batch events in order (row history)
        self.rows: dict[Any, Rows] = {}  # pid -> what its accepted-count buffer rows hold (acc_rows)
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
        issues, done, moves, rows_of = self.issues, self.done, self.moves, self.rows
        READ, ISSUE, DONE, REMOVE = (kind_code("acc.read"), kind_code("d2h.issue"), kind_code("d2h.done"),
                                     kind_code("batch.remove"))
        seq, codes = idx.ordered_codes(_KINDS)
        for e, code in zip(seq, codes):
            pid = e.get("pid")
            buf = rows_of.get(pid)
            if buf is None:
                buf = rows_of[pid] = Rows()
            if code == READ:
                self._read(e, pid, buf)
            elif code == ISSUE:
                issues.setdefault(pid, {})[e.get("event")] = e
                self.last_issue[pid] = e
                buf.issue(e)
            elif code == DONE:
                done.setdefault(pid, {})[e.get("event")] = None
                buf.done(e)
            else:  # batch.*
                moves.setdefault(pid, []).append(e)
                if code != REMOVE:
                    buf.move(e)

    def _read(self, e: Event, pid: Any, buf: Rows) -> None:
        row, req, ev_id = e.get("row"), e.get("req"), e.get("event")
        # a race only where query() said False and the runner did not synchronize (an event
        # without query(), event_done None, is taken as landed, as before the replay)
        raced = (e.get("event_done") is False and e.get("synced") is not True
                 and not (ev_id is not None and ev_id in self.done.get(pid, ())))
        landed = not raced or (buf.pending is not None and buf.hi is not None)
        if landed:
            buf.synced()
        pts = buf.points(landed)
        own_ev = buf.latest.get(req)
        if own_ev is not None and len(pts) == 1 and buf.replay(pts[0])[0].get(row) == ("c", req, own_ev):
            return  # the common read: one possible landing point, and the row holds its own count
        outcomes = []
        for pt in pts:
            labels, writer = buf.replay(pt)
            lab = labels.get(row, INITIAL)
            outcomes.append((lab, writer.get(row)))
        labs = {o[0] for o in outcomes}

        def is_right(lb: tuple) -> bool:
            # its count from the latest copy that covered it; if none did since it joined, any
            # add_request / initial 1 (every such row holds the same 1)
            return lb == ("c", req, own_ev) if own_ev is not None else lb[0] in ("a", "i")

        # a racy read naming a copy the trace never issued (cut off by a ring window, or not
        # recorded) cannot be cleared from the rows replayed without that copy
        unseen_copy = bool(ev_id) and ev_id not in self.issues.get(pid, ())
        if all(map(is_right, labs)) and (own_ev is not None or landed or not unseen_copy):
            return
        issue = buf.pending if buf.pending is not None else self.last_issue.get(pid)
        raced_other = False
        if not landed and (buf.pending is not None or ev_id):
            # event.query() False, no synchronize: the read raced the copy, whichever way it went
            verdict = "copy-not-complete"
            lab, writer = outcomes[-1]  # the copy not landed yet
            raced_other = any(lb[0] in ("c", "a") and lb[1] != req for lb, _w in outcomes)
        elif any(map(is_right, labs)) or UNKNOWN in labs:
            verdict = "inconclusive"  # right at some possible landing point, wrong at another
            lab, writer = next(((lb, w) for lb, w in outcomes if not is_right(lb)), outcomes[0])
        else:  # wrong wherever the copy landed
            lab, writer = outcomes[0]
            verdict = "copy-not-complete" if (lab[0] == "c" and lab[1] == req) else "row-moved"
        dkey = (e.get("inst"), req, e.get("step"), row, e.get("value"))
        if dkey in self.seen:  # another TP rank read the same thing
            self.seen[dkey].append(e.get("rank"))
            return
        ranks = self.seen[dkey] = [e.get("rank")]
        mapping = e.get("mapping")
        if mapping is None and issue is not None:  # a trace from before the field: the row tells
            mapping = "prev" if req in issue["rows"] and issue["rows"].index(req) == row else "direct"
        own = buf.own.get(req) if own_ev is not None and issue is not None and issue.get("event") == own_ev else None
        self.stale.append((e, pid, row, req, ev_id, issue, verdict, raced_other, lab, writer, own,
                           _history(self.moves.get(pid, ()), issue, row, req), ranks, mapping))
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
        for pid, d in self.done.items():
            if len(d) > MAX_DONE + MAX_DONE // 4:
                for ev in list(d)[:len(d) - MAX_DONE]:
                    del d[ev]
                self.done[pid] = dict(d)
        for pid, mv in self.moves.items():
            if pid not in self.issues and len(mv) > MAX_MOVES_NO_ISSUE + MAX_MOVES_NO_ISSUE // 4:
                del mv[:len(mv) - MAX_MOVES_NO_ISSUE]
        for buf in self.rows.values():  # requests long gone: only those of the copy in flight can be read
            if len(buf.latest) > MAX_LATEST and buf.pending is not None:
                ev = buf.pending.get("event")
                buf.latest = {q: ev for q in buf.pending.get("rows") or () if q}

    def finish(self) -> list[Finding]:
        truths: dict[tuple, list[Event]] = {}
        for key, lst in self.truths.items():
            if lst:
                truths[key] = sorted(lst, key=_by_id)
        return [_finding(truths, *r) for r in self.stale]


_by_id = itemgetter("id")


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


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
            mv = [list(x) for x in m["moves"] if valid_condense_move(x) and (x[0] == req or row in (x[1], x[2]))]
            if mv:
                hist.append({"event": m["id"], "op": "condense", "moves": mv})
        elif m.get("row") == row or m.get("req") == req:
            hist.append({"event": m["id"], "op": mk.split(".", 1)[1], "row": m.get("row"),
                         "req": m.get("req")})
    return hist


def _label_text(lab: tuple) -> str:
    if lab[0] == "c":
        return f"{lab[1] or 'an empty row'}'s count from copy {lab[2]!r}"
    if lab[0] == "a":
        return f"the 1 that add_request wrote for {lab[1]}"
    if lab[0] == "i":
        return "the buffer's initial 1 (no copy or add_request wrote it in the trace)"
    return "a value the trace cannot tell"


def _writer_text(w: Event | None) -> str:
    if w is None:
        return "a write before the trace's window"
    k = w.get("ev")
    if k == "d2h.issue":
        return f"the D2H copy {w.get('event')!r} (trace event {w.get('id')})"
    if k == "batch.add":
        return f"add_request({w.get('req')}) into row {w.get('row')} (trace event {w.get('id')})"
    if k == "batch.swap":
        return (f"swap_states({w['i1']}, {w['i2']}) ({w.get('req1')}<->{w.get('req2')}, trace event {w.get('id')})")
    if k == "batch.condense":
        return "condense (" + ", ".join(f"{q} {a}->{b}" for q, a, b in w["moves"][:4]) + f", trace event {w.get('id')})"
    return f"{k} (trace event {w.get('id')})"


def _finding(truths: dict[tuple, list[Event]], e: Event, pid: Any, row: Any, req: Any, ev_id: Any,
             issue: Event | None, verdict: str, raced_other: bool, lab: tuple, writer: Event | None, own: Any,
             hist: list[dict], ranks: list, mapping: Any) -> Finding:
    truth = _truth_for(truths.get((e.get("inst"), req), []), e)
    tval = truth["value"] if truth is not None else None
    ref, ref_name = (own, "the copy's own count") if own is not None else (tval, "authoritative value")
    # unsynchronized, the copy carries the authoritative count (align mode's synchronized path copies 1 by
    # design): a value other than acc.truth is a wrong read wherever the copy landed (issue 50, item 4)
    wrong_anyway = (verdict == "inconclusive" and e.get("synced") is not True and tval is not None
                    and e["value"] != tval)
    if wrong_anyway:
        severity = SEVERITY_ERROR
    elif verdict == "inconclusive":
        severity = SEVERITY_INCONCLUSIVE
    elif ref is not None:
        severity = SEVERITY_ERROR if ref != e["value"] else SEVERITY_WARNING
    else:
        severity = SEVERITY_ERROR if verdict == "row-moved" else SEVERITY_WARNING
    reasons = {"row-moved": ["row-moved"], "copy-not-complete": ["copy-not-complete"],
               "inconclusive": ["landing-unknown"]}[verdict]
    if wrong_anyway:
        reasons = ["landing-unknown", "value-wrong"]
    if raced_other:
        reasons = ["row-moved", *reasons]  # raced, and had the copy landed the row held another request's count
    rows = issue["rows"] if issue is not None else []
    row_req_at_issue = rows[row] if isinstance(row, int) and 0 <= row < len(rows) else None
    issue_row_of_req = rows.index(req) if req in rows else None
    ids = [x for x in (issue["id"] if issue is not None else None, e["id"],
                       writer.get("id") if writer is not None else None,
                       truth["id"] if truth is not None else None) if x is not None]
    ids += [h["event"] for h in hist]
    how = " through its previous-step row (prev_positions)" if mapping == "prev" else (
        " from its current row" if mapping == "direct" else "")
    vtxt = (f"read {e['value']}, {ref_name} {ref}" if ref is not None
            else f"read {e['value']} (no count of its own recorded)")
    where = f"row {row} held {_label_text(lab)}"
    if verdict == "row-moved":
        cause = (f"{_writer_text(writer)} put it there after the copy"
                 + (f" {issue.get('event')!r} landed" if issue is not None else ""))
        title = f"request {req} step {e.get('step')}: accepted count read from row {row} is another row's ({vtxt})"
        expl = (f"_prepare_inputs read num_accepted_tokens for {req}{how} on {e.get('inst')} (pid {pid}, "
                f"step {e.get('step')}), but {where}: {cause}. It {vtxt}. "
                + ("The request used a wrong accepted count (wrong recurrent-state slot / positions). "
                   if severity == SEVERITY_ERROR else
                   "The value happened to be the request's own, but the row held another request's count. ")
                + (f"The copy landed before this row move and the gather through the previous rows does not "
                   f"follow it: {UPSTREAM} (open; fix proposed in #51599: a snapshot buffer that row moves do not touch)."
                   if mapping == "prev" else
                   "The read takes the current row, which the copy (landing after the move) filled with the "
                   "request that sat there at issue: vLLM thread 004 (fixed in 0.24.0)."))
    elif verdict == "copy-not-complete":
        title = f"request {req} step {e.get('step')}: accepted count read from row {row} raced the D2H copy ({vtxt})"
        expl = (f"_prepare_inputs read num_accepted_tokens for {req}{how} on {e.get('inst')} (pid {pid}, "
                f"step {e.get('step')}) before the copy {ev_id!r} landed (event.query() False, no synchronize): "
                f"{where}. It {vtxt}.")
    elif wrong_anyway:
        title = (f"request {req} step {e.get('step')}: accepted count read from row {row} is wrong (read "
                 f"{e['value']}, authoritative value {tval}); how is not in the trace")
        expl = (f"_prepare_inputs read num_accepted_tokens for {req}{how} on {e.get('inst')} (pid {pid}, "
                f"step {e.get('step')}) without synchronizing, and read {e['value']} where the authoritative count "
                f"(acc.truth, step {truth.get('for_step') if truth else '?'}) is {tval}. On this path the copy "
                f"carries the authoritative count, so the read is wrong wherever the copy {ev_id!r} landed. Which "
                f"way it went is not in the trace (a recording without the moves' landed field): among the "
                f"{len(hist)} row move(s) after its issue, row {row} held the request's own count or "
                f"{_label_text(lab)} ({_writer_text(writer)}).")
    else:
        title = (f"request {req} step {e.get('step')}: accepted count read from row {row}: the copy's landing "
                 f"relative to the row moves is not in the trace")
        expl = (f"_prepare_inputs read num_accepted_tokens for {req}{how} on {e.get('inst')} (pid {pid}, "
                f"step {e.get('step')}). Depending on where the copy {ev_id!r} landed among the "
                f"{len(hist)} row move(s) after its issue, row {row} held the request's own count or "
                f"{_label_text(lab)} ({_writer_text(writer)}). The trace does not say which (a recording "
                f"without the moves' landed field): not a claim of a bug, and not clean. It {vtxt}.")
    return Finding(
        kind=STALE_ACCEPTED_COUNT_READ, severity=severity, req=req, step=e.get("step"),
        inst=e.get("inst"), event_ids=sorted(set(ids)), title=title, explanation=expl,
        data={"row": row, "value": e["value"], "truth": tval, "own": own, "reasons": reasons,
              # what the row held when read: (how it was written: "c" a copy, "a" add_request's 1, "i" the
              # buffer's initial 1, "u" unknown; whose; which copy), and the same in words
              "held": list(lab), "row_held": _label_text(lab),
              "moved_by": writer.get("id") if writer is not None else None,
              "mapping": mapping, "upstream": UPSTREAM if verdict == "row-moved" and mapping == "prev" else None,
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
