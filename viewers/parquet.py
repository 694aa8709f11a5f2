"""Parquet export: one table per event kind, for DuckDB, Spark, pandas or any Arrow reader.

``write(path, out_dir)`` streams the trace (``pdtrace.tracefile.trace.scan``: every line validated as
``check`` does) and appends each event to its kind's table, flushing a row group every
``batch`` events of that kind, and every kind's buffer whenever ``budget`` events are buffered
in all, so memory stays bounded by ``budget`` events whatever the trace's length. Output, in ``out_dir``:

- ``<kind>.parquet`` (``acc.read.parquet``, ``nixl.trim.parquet``, ...): the common fields
  (``id ev t w pid role inst rank step req sim``) then the kind's fields in schema order
  (``pdtrace.schema``), typed: ``int`` int64, ``str`` string, ``bool``, ``float`` float64,
  ``list[int]`` / ``list[str]`` / ``list[list[int]]`` Arrow lists. Fields of other declared
  types (dicts, lists of dicts) are JSON text, and so is ``extra``: the fields an event has
  beyond its kind's (a newer writer's), or null;
- ``_trace.json``: the header, the footer, the load problems and the row count per table
  (what a query over a fleet of exports needs to tell traces apart).

Needs ``pyarrow`` (``pip install 'pdtrace[parquet]'``); nothing here imports vLLM or torch.
Example (DuckDB): ``SELECT req, count(*) FROM 'out/acc.read.parquet' GROUP BY req``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import orjson

from pdtrace import schema
from pdtrace.errors import PdtraceError

_ARROW_TYPES = ("int", "str", "bool", "float", "list[int]", "list[str]", "list[list[int]]")


def _arrow_type(pa: Any, t: str) -> Any:
    t = t.replace(" ", "")
    return {"int": pa.int64(), "str": pa.string(), "bool": pa.bool_(), "float": pa.float64(),
            "list[int]": pa.list_(pa.int64()), "list[str]": pa.list_(pa.string()),
            "list[list[int]]": pa.list_(pa.list_(pa.int64()))}.get(t, pa.string())


class _Table:
    """One kind's columns, buffered and flushed as row groups."""

    def __init__(self, pa: Any, pq: Any, kind: str, path: str, batch: int):
        fields = list(schema.COMMON) + [f for f in schema.KINDS[kind].fields if f.name not in schema.COMMON_NAMES]
        self.names = [f.name for f in fields]
        self.json_cols = {f.name for f in fields if f.type.replace(" ", "") not in _ARROW_TYPES}
        self.known = frozenset(self.names)
        self.schema = pa.schema([(f.name, _arrow_type(pa, f.type)) for f in fields] + [("extra", pa.string())])
        self.cols: dict[str, list] = {n: [] for n in self.names + ["extra"]}
        self.pa, self.batch, self.kind = pa, batch, kind
        self.writer = pq.ParquetWriter(path, self.schema, compression="zstd")
        self.rows = 0

    def add(self, e: dict[str, Any]) -> None:
        cols = self.cols
        for n in self.names:
            v = e.get(n)
            if v is not None and n in self.json_cols:
                v = orjson.dumps(v).decode()
            cols[n].append(v)
        extra = {k: v for k, v in e.items() if k not in self.known}
        cols["extra"].append(orjson.dumps(extra).decode() if extra else None)
        if len(cols["extra"]) >= self.batch:
            self.flush()

    def flush(self) -> None:
        n = len(self.cols["extra"])
        if not n:
            return
        try:
            table = self.pa.Table.from_pydict(self.cols, schema=self.schema)
        except (self.pa.ArrowInvalid, self.pa.ArrowTypeError) as exc:
            raise PdtraceError(f"parquet export: {self.kind}: a value does not fit its schema type: {exc}") from None
        self.writer.write_table(table)
        self.rows += n
        self.cols = {k: [] for k in self.cols}

    def close(self) -> None:
        self.flush()
        self.writer.close()


def write(path: str, out_dir: str | os.PathLike, *, lenient: bool = False, batch: int = 65536,
          budget: int = 65536, progress: Any = None) -> dict[str, Any]:
    """Export the trace at ``path`` into ``out_dir`` (created); returns per-kind row counts."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PdtraceError("the Parquet export needs pyarrow: pip install 'pdtrace[parquet]' (or pip install pyarrow)") from None
    from pdtrace.tracefile.trace import scan

    os.makedirs(out_dir, exist_ok=True)
    tables: dict[str, _Table] = {}
    header: dict[str, Any] = {}
    footer = None
    problems: list[dict[str, Any]] = []
    n = pending = 0
    try:
        for what, line, obj in scan(str(path), lenient=lenient, progress=progress):
            if what == "event":
                if "id" not in obj:
                    obj["id"] = n
                n += 1
                kind = obj["ev"]
                t = tables.get(kind)
                if t is None:
                    if kind not in schema.KINDS:  # a newer kind kept by --lenient: no schema to type it
                        problems.append({"line": line, "reason": f"{kind}: not exported (unknown kind)"})
                        continue
                    t = tables[kind] = _Table(pa, pq, kind, os.path.join(str(out_dir), f"{kind}.parquet"), batch)
                t.add(obj)
                pending += 1
                if pending >= budget:  # all kinds together: memory bounded whatever the number of kinds
                    for x in tables.values():
                        x.flush()
                    pending = 0
            elif what == "header":
                header = obj
            elif what == "footer":
                footer = obj
            else:
                problems.append({"line": line, "reason": obj})
    finally:
        for t in tables.values():
            t.close()
    rows = {k: t.rows for k, t in sorted(tables.items())}
    meta = {"trace": os.path.basename(str(path)), "header": header, "footer": footer, "problems": problems,
            "tables": {k: f"{k}.parquet" for k in rows}, "rows": rows}
    with open(os.path.join(str(out_dir), "_trace.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    return {"events": n, "tables": len(rows), "rows": rows, "problems": len(problems)}
