"""The columns of a ``TraceIndex`` and the questions the viewers ask of them: a request's
events, a step's events on an instance, the steps of an instance, the first event of a kind,
a request's instances, the raw-text search. ``TraceIndex`` (``trace_index``) builds the
columns; this mixin only reads them. No Textual, no vLLM."""

from __future__ import annotations

from typing import Any, Iterable

from .. import schema

KIND_NAMES: tuple[str, ...] = tuple(schema.KINDS)
KIND_CODE: dict[str, int] = {k: i for i, k in enumerate(KIND_NAMES)}
UNKNOWN_KIND = 255  # an unknown kind kept in a newer trace read leniently
NO_STEP = -1
NO_REQ = -1


class ColumnQueries:
    """Queries over the columns ``TraceIndex`` fills (``kinds``, ``steps``, ``insts``,
    ``req_code`` / ``req_events`` / ``req_insts``, ``step_ranges``, ``first_of_kind``)."""

    # ---------------------------------------------------------------- queries on columns
    def request_ordinals(self, req: str, kinds: Iterable[str] | None = None) -> list[int]:
        rc = self.req_code.get(req)
        if rc is None:
            return []
        ords = self.req_events[rc]
        if kinds is None:
            return list(ords)
        want = {KIND_CODE[k] for k in kinds if k in KIND_CODE}
        kc = self.kinds
        return [i for i in ords if kc[i] in want]

    def step_ordinals(self, step: int, inst: str | None = None, kinds: Iterable[str] | None = None) -> list[int]:
        """Events whose effective step is ``step`` (on ``inst``, or on every instance)."""
        want = None if kinds is None else {KIND_CODE[k] for k in kinds if k in KIND_CODE}
        out: list[int] = []
        codes = range(len(self.inst_names)) if inst is None else [self.inst_code.get(inst, -1)]
        for ic in codes:
            r = self.step_ranges.get((ic, step))
            if r is None:
                continue
            st, ins, kc = self.steps, self.insts, self.kinds
            for i in range(r[0], r[1] + 1):
                if st[i] == step and ins[i] == ic and (want is None or kc[i] in want):
                    out.append(i)
        out.sort()
        return out

    def kind_ordinals(self, kind: str) -> list[int]:
        """Every event of ``kind``, in order (a byte search over the kind column)."""
        code = KIND_CODE.get(kind)
        if code is None:
            return []
        col, out = self.kinds.tobytes(), []
        i = col.find(code)
        while i >= 0:
            out.append(i)
            i = col.find(code, i + 1)
        return out

    def steps_of(self, inst: str | None = None) -> list[int]:
        if inst is None:
            return sorted({s for (_ic, s) in list(self.step_ranges)})
        ic = self.inst_code.get(inst, -1)
        return sorted(s for (c, s) in list(self.step_ranges) if c == ic)

    def first(self, kind: str, inst: str) -> dict[str, Any] | None:
        i = self.first_of_kind.get((self.inst_code.get(inst, -1), KIND_CODE.get(kind, -1)))
        return None if i is None else self.event(i)

    def request_insts(self, req: str) -> list[str]:
        rc = self.req_code.get(req)
        if rc is None:
            return []
        mask = self.req_insts[rc]
        return sorted(name for ic, name in enumerate(self.inst_names[:8]) if mask >> ic & 1)

    def search(self, text: str, start: int = 0, direction: int = 1) -> int | None:
        """The ordinal of the next event whose JSON line contains ``text`` (``pdtrace.index.search``)."""
        from .search import search

        return search(self, text, start, direction)

    def memory_bytes(self) -> int:
        """Approximate bytes held by the columns (not the cache)."""
        cols = (self.starts, self.lengths, self.kinds, self.steps, self.reqs, self.insts)
        n = sum(a.buffer_info()[1] * a.itemsize for a in cols)
        n += sum(a.buffer_info()[1] * a.itemsize for a in self.req_events.values())
        return n
