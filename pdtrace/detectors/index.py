"""A small shared index over loaded events, built in one pass and reused by detectors/viewers.

``build(events)`` groups events by kind (each list keeps trace order) and caches the result
for the same list object, so ``run_all`` and the viewers pay for one pass, not one per
detector; for a list from ``pdtrace.tracefile.trace.load`` the loader already grouped the events in
its parse loop (``EventList.by_kind``), so there is no pass at all. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import functools
from operator import itemgetter
from typing import Any, Iterable

from pdtrace.tracefile.trace import kind_code, kind_groups, select_kinds

Event = dict[str, Any]

_by_id = itemgetter("id")

# group spec classes whose blocks are indexed by token position (clipped by the fix);
# anything else (Mamba / SSM / unknown state specs) is a "state" group and never clipped.
_ATTN_MARKERS = ("Attention", "SlidingWindow", "MLA", "ChunkedLocal")
_STATE_MARKERS = ("Mamba", "SSM", "State", "Conv")


@functools.lru_cache(maxsize=256)  # a trace names a handful of spec classes, asked per transfer
def is_attention_group(kind: str | None) -> bool:
    """True for token-indexed KV groups (full / sliding-window / MLA / sink attention)."""
    if not kind:
        return True  # no group_kinds recorded: assume plain attention
    if any(m in kind for m in _STATE_MARKERS):
        return False
    return any(m in kind for m in _ATTN_MARKERS)


class Configs:
    """The ``sched.config`` events of a trace, answering "which scheduler emitted this event"
    (block sizes, group kinds, KV role). ``add`` takes more configs as a stream reads them
    (``pdtrace.detectors.stream``); in a recording each scheduler's config precedes its events."""

    def __init__(self, configs: Iterable[Event] = ()):
        self._all: list[Event] = []
        self._configs: dict[str, Event] = {}
        self._by_sched: dict[tuple, Event] | None = None  # (pid, sched) -> config, built on first use
        self._by_proc: dict[tuple, list[Event]] = {}
        self.add(configs)

    def add(self, configs: Iterable[Event]) -> None:
        for c in configs:
            self._all.append(c)
            self._configs.setdefault(c.get("inst", ""), c)  # first config per instance
            self._by_sched = None

    def __len__(self) -> int:
        return len(self._all)

    def config(self, inst: str | None) -> Event | None:
        """The scheduler config of an instance (first ``sched.config`` it emitted)."""
        c = self._configs.get(inst or "")
        if c is None and len(self._configs) == 1:
            c = next(iter(self._configs.values()))
        return c

    def config_of(self, e: Event) -> Event | None:
        """The ``sched.config`` of the scheduler that emitted ``e``: same pid and ``sched``
        ordinal when both are recorded; else the latest config of the same pid and
        instance before ``e``; else the instance's first config (``config``)."""
        by_sched = self._by_sched
        if by_sched is None:
            by_sched, by_proc = {}, {}
            for c in self._all:
                if c.get("sched") is not None:
                    by_sched.setdefault((c.get("pid"), c["sched"]), c)
                by_proc.setdefault((c.get("pid"), c.get("inst", "")), []).append(c)
            self._by_sched, self._by_proc = by_sched, by_proc
        sid = e.get("sched")
        if sid is not None:
            c = by_sched.get((e.get("pid"), sid))
            if c is not None:
                return c
        cands = self._by_proc.get((e.get("pid"), e.get("inst", "")))
        if cands:
            at = e.get("id")
            best = cands[0]
            if at is not None:
                for c in cands:
                    if c.get("id", -1) < at:
                        best = c
            return best
        return self.config(e.get("inst"))

    def block_sizes(self, inst: str | None) -> list[int] | None:
        c = self.config(inst)
        return list(c["block_sizes"]) if c else None

    def group_kinds(self, inst: str | None) -> list[str] | None:
        c = self.config(inst)
        return list(c.get("group_kinds") or []) if c else None


class Index:
    """Events grouped by kind (trace order inside each list) plus the scheduler configs.

    ``configs``: a ``Configs`` shared with other indexes (a stream indexes one segment of
    events at a time, and the configs of earlier segments still answer); by default the
    configs among ``events``."""

    def __init__(self, events: list[Event], configs: Configs | None = None):
        self.events = events
        by_kind = kind_groups(events)  # grouped by the loader in its parse loop
        # every event's id is its position (a list from trace.load that says so, as loaded):
        # trace order by id is list order, and each kind's list is sorted by id
        self.ids_aligned = by_kind is not None and bool(getattr(events, "ids_aligned", False))
        if by_kind is None:
            by_kind = {}
            get = by_kind.get
            for e in events:
                k = e["ev"]
                lst = get(k)
                if lst is None:
                    by_kind[k] = [e]
                else:
                    lst.append(e)
        self.by_kind = by_kind
        self.configs = configs if configs is not None else Configs(by_kind.get("sched.config", ()))
        self.config = self.configs.config
        self.config_of = self.configs.config_of
        self.block_sizes = self.configs.block_sizes
        self.group_kinds = self.configs.group_kinds

    def kind(self, name: str) -> list[Event]:
        return self.by_kind.get(name, [])

    def ordered(self, kinds: Iterable[str]) -> list[Event]:
        """Events of several kinds merged back into trace order (by ``id``)."""
        kinds = tuple(kinds)
        picked = select_kinds(self.events, kinds)  # loaded list: picked by the kind codes
        if picked is not None:
            return picked
        out: list[Event] = []
        for k in kinds:
            out.extend(self.by_kind.get(k, ()))
        out.sort(key=_by_id)  # timsort merges the already-sorted runs in ~linear time
        return out

    def ordered_codes(self, kinds: Iterable[str]) -> tuple[list[Event], bytes]:
        """``ordered(kinds)`` and, in parallel, each event's kind as a byte
        (``pdtrace.tracefile.trace.kind_code``): loops dispatch on it without reading ``ev``."""
        kinds = tuple(kinds)
        picked = select_kinds(self.events, kinds, with_codes=True)
        if picked is not None:
            return picked
        out = self.ordered(kinds)
        return out, bytes(kind_code(e["ev"]) for e in out)


_cache: tuple[list[Event], int, Index] | None = None


def build(events: list[Event]) -> Index:
    """The index of ``events``, reused while the same list (same length) is passed again."""
    global _cache
    if _cache is not None and _cache[0] is events and _cache[1] == len(events):
        return _cache[2]
    idx = Index(events)
    _cache = (events, len(events), idx)
    return idx


def feed_all(stream: Any, events: list[Event]) -> list:
    """A detector's findings over a whole event list: its ``Stream`` fed the list as one
    segment (``pdtrace.detectors.stream`` feeds a trace segment by segment instead)."""
    stream.feed(build(events))
    return stream.finish()
