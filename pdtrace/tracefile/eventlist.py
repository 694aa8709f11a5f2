"""The loaded event list (``EventList``) and what the loader learned about it in the same
pass: kind groups, a kind byte per event, whether ids are positions. Also importable from
``pdtrace.tracefile.trace``."""

from __future__ import annotations

from itertools import compress
from typing import Any, Iterable

from .. import schema

_KIND_REQUIRED = {name: schema.REQUIRED_COMMON | k.required for name, k in schema.KINDS.items()}
_KIND_CODE = {name: code for code, name in enumerate(_KIND_REQUIRED, 1)}  # 0: none


class EventList(list):
    """The loaded events: a plain ``list`` to every caller, plus what the loader learned in
    the same pass, while each event was still hot in the CPU cache:

    - ``by_kind``: each kind's events in trace order (``pdtrace.detectors.index`` reuses
      it instead of regrouping);
    - ``kind_codes``: one byte per event, its kind (``select_kinds`` picks several kinds in
      trace order from it without touching the events);
    - ``ids_aligned``: every event's ``id`` is its position (so trace order by ``id`` is
      list order);
    - ``blocks_derived``: ``derive_block_lists`` has nothing (more) to do on these events.

    ``None`` / False where the loader did not record it (a lenient or damaged file). All of
    it describes the list as loaded (``loaded_len`` events): once its length changes it is
    ignored (``kind_groups`` / ``select_kinds`` answer None, ``derive_block_lists`` walks
    it again). Editing events in place (reordering, replacing) is not detected."""

    __slots__ = ("by_kind", "kind_codes", "ids_aligned", "blocks_derived", "loaded_len")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.by_kind: dict[str, list[dict[str, Any]]] | None = None
        self.kind_codes: bytearray | None = None
        self.ids_aligned = False
        self.blocks_derived = False
        self.loaded_len = -1

    def as_loaded(self) -> bool:
        """Whether the list still has the length the loader left it with."""
        return len(self) == self.loaded_len


def kind_groups(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]] | None:
    """The loader's per-kind grouping of ``events`` (see ``EventList``), or None when ``events``
    is not a loaded list or no longer has the length it was loaded with."""
    if not isinstance(events, EventList) or not events.as_loaded():
        return None
    return events.by_kind


def kind_code(kind: str) -> int:
    """The byte that stands for ``kind`` in ``EventList.kind_codes`` (0: not a schema kind)."""
    return _KIND_CODE.get(kind, 0)


def select_kinds(events: list[dict[str, Any]], kinds: Iterable[str],
                 with_codes: bool = False) -> Any:
    """The events of ``kinds`` in trace order (= sorted by ``id``), picked through the
    loader's ``kind_codes`` without touching the other events -- with ``with_codes``, a pair
    (events, their ``kind_code`` bytes) --; None when ``events`` is not a loaded list whose
    ids are its positions, or no longer has its loaded length."""
    if not isinstance(events, EventList) or not events.as_loaded() or not events.ids_aligned:
        return None
    codes = events.kind_codes
    if codes is None:
        return None
    wanted = {_KIND_CODE.get(k, 0) for k in kinds} - {0}
    picked = list(compress(events, codes.translate(bytes(c in wanted for c in range(256)))))
    if with_codes:
        return picked, bytes(codes.translate(None, bytes(c for c in range(256) if c not in wanted)))
    return picked
