"""P's and D's request ids paired as vLLM pairs them (``nixl/utils.py``'s ``get_base_request_id``).

vLLM's input processor appends ``-<8 hex>`` to every request id it is given (``assign_request_id``), so P's and
D's internal ids for one router request differ in that suffix. In pull mode D's ``remote_request_id`` is P's
internal id (from P's kv_transfer_params); a router can hand D its own id instead (push mode pairs by it: P's
writer thread matches D's registration by the exact id, then by the id with the suffix stripped from both sides).
pdtrace pairs the same way: the exact id first, then the base id, among the ids not paired yet.
"""

from __future__ import annotations

import re
from typing import Any

_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_id(rid: Any) -> str:
    """``rid`` without vLLM's random suffix (vLLM's ``get_base_request_id``)."""
    return _SUFFIX.sub("", str(rid))


class BaseIndex:
    """Ids seen, by base id (the latest first), for the fallback lookup; bounded like the tables it serves."""

    def __init__(self, keep: int = 1 << 15) -> None:
        self.keep = keep
        self.by_base: dict[str, list[str]] = {}

    def add(self, rid: Any) -> None:
        b = base_id(rid)
        lst = self.by_base.setdefault(b, [])
        if str(rid) not in lst:
            lst.append(str(rid))
        if len(self.by_base) > self.keep:
            del self.by_base[next(iter(self.by_base))]

    def match(self, rid: Any, table: Any) -> str | None:
        """The id of ``table`` that pairs with ``rid``: ``rid`` itself when ``table`` holds it, else the oldest id of
        the same base id that ``table`` still holds (vLLM's order: the first registration that matches)."""
        if rid is None or rid in table:
            return rid
        return next((c for c in self.by_base.get(base_id(rid), ()) if c in table), None)
