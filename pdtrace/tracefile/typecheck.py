"""Type checks of whole events against ``pdtrace.schema``, fast enough for every event.

``EventChecker`` judges an event once per *shape* (its kind, its keys in order and each
value's type): the first event of a shape gets the full check (known kind, required fields
present, each field of its declared type: ``schema.type_error``) and a valid shape is
remembered, so later events of that shape cost one dict lookup plus a check of the elements
of their list / dict fields (list[int], dict[str,str], ...). Writers emit a handful of
shapes per kind, so almost every event takes the short way.

``Signer`` is the writer's side of the footer ``digest``: a CRC-32 of the event lines,
written only when every event was type-checked here on its way into the file. A reader that
finds the digest matching the bytes it read knows the events are the ones this check
passed, and skips its own type checks (``pdtrace.tracefile.trace``); any other file is checked event
by event. The digest guards against damage and hand edits, not against a forged file.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

from .. import schema

_REQUIRED = {name: schema.REQUIRED_COMMON | k.required for name, k in schema.KINDS.items()}
_NESTED = {kind: {name: c[0] for name, c in checks.items() if schema.nested_type(c[1])}
           for kind, checks in schema.FIELD_CHECKS.items()}
DIGEST_PREFIX = "crc32:"


def shape_of(obj: dict[str, Any]) -> tuple:
    return (obj["ev"], tuple(obj), tuple(map(type, obj.values())))


class EventChecker:
    """``ok(event)``: whether an event is valid for this schema (see the module doc)."""

    __slots__ = ("shapes",)

    def __init__(self) -> None:
        # shape -> the check of the elements of its list / dict fields (None: nothing to check)
        self.shapes: dict[tuple, Callable[[dict], bool] | None] = {}

    def ok(self, obj: Any) -> bool:
        try:
            nested = self.shapes[(obj["ev"], tuple(obj), tuple(map(type, obj.values())))]
        except (KeyError, TypeError, AttributeError):
            return self.learn(obj)
        return nested is None or nested(obj)

    def learn(self, obj: Any) -> bool:
        """The full check of an event of a shape not seen yet; remembers the shape if valid."""
        if type(obj) is not dict:
            return False
        kind = obj.get("ev")
        if type(kind) is not str or kind not in _REQUIRED or not obj.keys() >= _REQUIRED[kind] \
                or schema.type_error(obj, schema.FIELD_CHECKS[kind], kind) is not None:
            return False
        nested_of_kind = _NESTED[kind]
        nested = _nested_check([(name, nested_of_kind[name]) for name, v in obj.items()
                                if v is not None and name in nested_of_kind])
        self.shapes[shape_of(obj)] = nested
        return nested is None or nested(obj)


def _nested_check(fields: list[tuple[str, Callable]]) -> Callable[[dict], bool] | None:
    if not fields:
        return None
    if len(fields) == 1:
        (a, ca), = fields
        return lambda o: ca(o[a])
    if len(fields) == 2:
        (a, ca), (b, cb) = fields
        return lambda o: ca(o[a]) and cb(o[b])
    if len(fields) == 3:
        (a, ca), (b, cb), (c, cc) = fields
        return lambda o: ca(o[a]) and cb(o[b]) and cc(o[c])
    return lambda o: all(c(o[n]) for n, c in fields)


class Signer:
    """The writer's side of the footer ``digest``: ``add(event, line)`` for each event line as
    written (newline included); ``digest()`` is None when any event failed the type check."""

    __slots__ = ("crc", "checker", "invalid")

    def __init__(self) -> None:
        self.crc = 0
        self.checker = EventChecker()
        self.invalid = 0

    def add(self, event: dict[str, Any], line: bytes) -> None:
        self.crc = zlib.crc32(line, self.crc)
        if not self.checker.ok(event):
            self.invalid += 1

    def digest(self) -> str | None:
        return None if self.invalid else digest_of(self.crc)


def digest_of(crc: int) -> str:
    return f"{DIGEST_PREFIX}{crc:08x}"
