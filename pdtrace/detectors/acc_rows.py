"""What each row of a worker's accepted-count host buffer holds, replayed from the trace.

The stale-read detector (``stale_read``) follows the data, not the code path: every row of
``InputBatch.num_accepted_tokens_cpu`` carries a *label* saying whose count it holds, and each
recorded event changes the labels the way vLLM changes the buffer (0.19.0 through 0.33.0,
``v1/worker/gpu_input_batch.py``):

- a D2H copy landing (``d2h.issue`` rows): row ``r`` gets ``("c", rows[r], copy)``, the count
  of the request that sat in row ``r`` when the copy was issued;
- ``add_request`` (``batch.add``): ``num_accepted_tokens_cpu[row] = 1``: ``("a", req)``;
- ``swap_states`` (``batch.swap``): the two rows' values are exchanged;
- ``condense`` (``batch.condense``): each moved request's value is copied into its new row
  (the old row keeps its value);
- ``remove_request``: the buffer is not touched.

A copy lands at one point among the row moves that follow its issue. Where that point is
known (``d2h.done`` before a move; a move's ``landed: after``; a blocking copy) the replay is
exact. Where it is not, every possible point is replayed: a read whose row holds the same label
at all of them is decided, any other is inconclusive. A copy into a buffer that does not move
with the rows (``moves_with_rows: false``, the runner-owned snapshot of vLLM PR #51599) is read
through the rows it was issued with.
"""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]
Label = tuple  # ("c", req, copy event id) | ("a", req) | ("i",) (never written) | ("u",) (unknown)
UNKNOWN: Label = ("u",)
INITIAL: Label = ("i",)  # InputBatch allocates the buffer with torch.ones: a 1 nobody wrote
MOVE_KINDS = ("batch.add", "batch.swap", "batch.condense")


def apply_move(labels: dict[int, Label], writer: dict[int, Event] | None, m: Event) -> None:
    """Change ``labels`` (row -> label) as InputBatch's move ``m`` changes the buffer;
    ``writer`` (row -> the move that last wrote it) likewise when given."""
    k = m["ev"]
    if k == "batch.add":
        row = m.get("row")
        if isinstance(row, int) and row >= 0:
            labels[row] = ("a", m.get("req"))
            if writer is not None:
                writer[row] = m
    elif k == "batch.swap":
        a, b = m["i1"], m["i2"]
        la, lb = labels.get(a, INITIAL), labels.get(b, INITIAL)
        labels[a], labels[b] = lb, la
        if writer is not None:
            writer[a] = writer[b] = m
    elif k == "batch.condense":
        moves = m["moves"]
        if not all(valid_condense_move(x) for x in moves):
            # a damaged record (read with --lenient): what the rows hold is no longer known
            for r in list(labels):
                labels[r] = UNKNOWN
            for x in moves:
                if isinstance(x, list) and len(x) == 3 and isinstance(x[2], int):
                    labels[x[2]] = UNKNOWN
            return
        for _req, old, new in moves:
            labels[new] = labels.get(old, INITIAL)
            if writer is not None:
                writer[new] = m


def valid_condense_move(x: Any) -> bool:
    """[request id, old row, new row], as hooks/input_batch.py records it."""
    return isinstance(x, list) and len(x) == 3 and isinstance(x[1], int) and isinstance(x[2], int)


def land(labels: dict[int, Label], writer: dict[int, Event] | None, issue: Event) -> None:
    ev = issue.get("event")
    for r, q in enumerate(issue["rows"]):
        labels[r] = ("c", q, ev)
        if writer is not None:
            writer[r] = issue


class Rows:
    """One worker process's buffer: the labels before the latest copy (``base``), that copy
    (``pending``) with the row moves since its issue, and the bounds on where it landed."""

    __slots__ = ("base", "pending", "moves", "lo", "hi", "own", "latest", "_cache")

    def __init__(self) -> None:
        self.base: dict[int, Label] = {}
        self.pending: Event | None = None
        self.moves: list[Event] = []
        self.lo = 0  # the copy landed after this many of ``moves`` at least
        self.hi: int | None = None  # ... and after at most this many (None: not known to have landed)
        self.own: dict[str, int] = {}  # req -> its own count in the pending copy (d2h values)
        self.latest: dict[str, Any] = {}  # req -> the copy event whose rows last held it
        self._cache: dict[Any, tuple[dict[int, Label], dict[int, Event]]] = {}

    # -- events ----------------------------------------------------------------------------
    def issue(self, e: Event) -> None:
        if self.pending is not None:
            self._settle()
        self.pending = e
        self.moves = []
        self.lo, self.hi = 0, None
        self._cache = {}
        rows = e.get("rows") or []
        ev = e.get("event")
        for q in rows:
            if q:
                self.latest[q] = ev
        vals = e.get("values")
        self.own = {q: v for q, v in zip(rows, vals) if q} if isinstance(vals, list) else {}
        if e.get("blocking") is True:
            self.hi = 0

    def done(self, e: Event) -> None:
        p = self.pending
        if p is None or e.get("event") != p.get("event"):
            return
        if self.hi is None or self.hi > len(self.moves):
            self.hi = len(self.moves)
            self._cache = {}
        vals = e.get("values")
        if isinstance(vals, list) and not self.own:
            self.own = {q: v for q, v in zip(p["rows"], vals) if q}

    def move(self, m: Event) -> None:
        if m["ev"] == "batch.add" and m.get("req") in self.latest:
            del self.latest[m["req"]]  # (re-)added: its count starts at add_request's 1
        p = self.pending
        if p is None or p.get("moves_with_rows") is False:
            apply_move(self.base, None, m)  # no copy in flight into these rows
            return
        self.moves.append(m)
        self._cache = {}
        if self.hi is not None:
            return  # the copy is known to have landed before this move
        landed = m.get("landed")
        if landed == "after":
            self.lo = len(self.moves)
        elif landed == "unknown":
            self.lo = max(self.lo, len(self.moves) - 1)

    def synced(self) -> None:
        """The runner synchronized on the copy (or saw it done): landed by now."""
        if self.pending is not None and self.hi is None:
            self.hi = len(self.moves)
            self._cache = {}

    # -- replay ----------------------------------------------------------------------------
    def points(self, landed_by_now: bool) -> list[int | None]:
        """Where the pending copy may have landed: an index into ``moves`` (it landed after that
        many of them), or None (it has not landed yet)."""
        if self.pending is None:
            return [None]
        hi = self.hi if self.hi is not None else len(self.moves)
        pts: list[int | None] = list(range(min(self.lo, hi), hi + 1))
        if self.hi is None and not landed_by_now:
            pts.append(None)
        return pts

    def replay(self, point: int | None) -> tuple[dict[int, Label], dict[int, Event]]:
        got = self._cache.get(point)
        if got is not None:
            return got
        writer: dict[int, Event] = {}
        p = self.pending
        if p is not None and p.get("moves_with_rows") is False:
            labels: dict[int, Label] = {}  # a snapshot: read through the rows it was issued with
            land(labels, writer, p)
        else:
            labels = dict(self.base)
            for i, m in enumerate(self.moves):
                if p is not None and point == i:
                    land(labels, writer, p)
                apply_move(labels, writer, m)
            if p is not None and point is not None and point >= len(self.moves):
                land(labels, writer, p)
        self._cache[point] = (labels, writer)
        return labels, writer

    def _settle(self) -> None:
        """Fold the pending copy into ``base`` before the next copy: rows on which the possible
        landing points disagree become unknown."""
        p = self.pending
        if p is not None and p.get("moves_with_rows") is not False:
            pts = [x for x in self.points(True) if x is not None] or [len(self.moves)]
            outs = [self.replay(x)[0] for x in pts]
            first = outs[0]
            if len(outs) > 1:
                rows = set().union(*outs)
                first = {r: (first.get(r, INITIAL) if all(o.get(r, INITIAL) == first.get(r, INITIAL) for o in outs)
                             else UNKNOWN) for r in rows}
            self.base = first  # (a fresh dict: the replay cache is dropped below)
        self.pending = None
        self.moves = []
        self._cache = {}
