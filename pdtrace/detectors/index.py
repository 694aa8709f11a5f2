"""A small shared index over loaded events, built in one pass and reused by detectors/viewers.

``build(events)`` groups events by kind (each list keeps trace order) and caches the result
for the same list object, so ``run_all`` and the viewers pay for one pass, not one per
detector. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Iterable

Event = dict[str, Any]

_by_id = itemgetter("id")

# group spec classes whose blocks are indexed by token position (clipped by the fix);
# anything else (Mamba / SSM / unknown state specs) is a "state" group and never clipped.
_ATTN_MARKERS = ("Attention", "SlidingWindow", "MLA", "ChunkedLocal")
_STATE_MARKERS = ("Mamba", "SSM", "State", "Conv")


def is_attention_group(kind: str | None) -> bool:
    """True for token-indexed KV groups (full / sliding-window / MLA / sink attention)."""
    if not kind:
        return True  # no group_kinds recorded: assume plain attention
    if any(m in kind for m in _STATE_MARKERS):
        return False
    return any(m in kind for m in _ATTN_MARKERS)


class Index:
    """Events grouped by kind (trace order inside each list) plus per-instance config."""

    def __init__(self, events: list[Event]):
        self.events = events
        by_kind: dict[str, list[Event]] = {}
        get = by_kind.get
        for e in events:
            k = e["ev"]
            lst = get(k)
            if lst is None:
                by_kind[k] = [e]
            else:
                lst.append(e)
        self.by_kind = by_kind
        self._configs: dict[str, Event] = {}
        for c in by_kind.get("sched.config", ()):
            self._configs.setdefault(c.get("inst", ""), c)  # first config per instance

    def kind(self, name: str) -> list[Event]:
        return self.by_kind.get(name, [])

    def ordered(self, kinds: Iterable[str]) -> list[Event]:
        """Events of several kinds merged back into trace order (by ``id``)."""
        out: list[Event] = []
        for k in kinds:
            out.extend(self.by_kind.get(k, ()))
        out.sort(key=_by_id)  # timsort merges the already-sorted runs in ~linear time
        return out

    def config(self, inst: str | None) -> Event | None:
        """The scheduler config of an instance (first ``sched.config`` it emitted)."""
        c = self._configs.get(inst or "")
        if c is None and len(self._configs) == 1:
            c = next(iter(self._configs.values()))
        return c

    def block_sizes(self, inst: str | None) -> list[int] | None:
        c = self.config(inst)
        return list(c["block_sizes"]) if c else None

    def group_kinds(self, inst: str | None) -> list[str] | None:
        c = self.config(inst)
        return list(c.get("group_kinds") or []) if c else None


_cache: tuple[list[Event], int, Index] | None = None


def build(events: list[Event]) -> Index:
    """The index of ``events``, reused while the same list (same length) is passed again."""
    global _cache
    if _cache is not None and _cache[0] is events and _cache[1] == len(events):
        return _cache[2]
    idx = Index(events)
    _cache = (events, len(events), idx)
    return idx
