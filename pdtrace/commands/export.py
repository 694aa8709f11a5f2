"""`pdtrace export TRACE --perfetto out.json | --perfetto-proto out.pftrace | --parquet DIR`.

- ``--perfetto``: Chrome / Perfetto trace-event JSON (``viewers.perfetto``);
- ``--perfetto-proto``: the same content in Perfetto's protobuf format, written with
  Perfetto's own builder (``viewers.perfetto_proto``; needs the ``perfetto`` package);
- ``--parquet``: one Parquet table per event kind (``viewers.parquet``; needs ``pyarrow``),
  streamed: memory does not grow with the trace.
Any combination; the trace is read once for the Perfetto outputs, once more for Parquet.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import PdtraceError


def run(trace: Path, perfetto: Path | None = None, lenient: bool = False, perfetto_proto: Path | None = None,
        parquet: Path | None = None) -> int:
    if perfetto is None and perfetto_proto is None and parquet is None:
        raise PdtraceError("nothing to export: give --perfetto FILE, --perfetto-proto FILE and/or --parquet DIR")
    _check_extras(perfetto_proto is not None, parquet is not None)
    if perfetto is not None or perfetto_proto is not None:
        from .report import load_with_findings

        tr, findings, note = load_with_findings(Path(trace), lenient)
        from ..viewers import perfetto as pf, perfetto_proto as pp

        for out, mod, said in ((perfetto, pf, _said_json), (perfetto_proto, pp, _said_proto)):
            if out is None:
                continue
            try:
                stats = mod.write(tr, out, findings)
            except OSError as exc:
                raise PdtraceError(f"cannot write {out}: {exc.strerror or exc}") from None
            print(f"wrote {out} ({said(stats)}); open it in https://ui.perfetto.dev", file=sys.stderr)
        if note:
            print(f"pdtrace: warning: {note}", file=sys.stderr)
        del tr
    if parquet is not None:
        from .progress import load_progress
        from ..viewers import parquet as pq

        try:
            st = pq.write(str(trace), parquet, lenient=lenient, progress=load_progress(str(trace)))
        except OSError as exc:
            raise PdtraceError(f"cannot write {parquet}: {exc.strerror or exc}") from None
        print(f"wrote {parquet}/ ({st['tables']} Parquet table(s), one per event kind, {st['events']:,} events"
              + (f", {st['problems']} problem line(s) not exported" if st["problems"] else "")
              + f"; {parquet}/_trace.json has the header and footer)", file=sys.stderr)
    return 0


def _said_json(st: dict) -> str:
    return (f"{st['events']:,} trace events, {st['flows']} KV flow(s), {st['findings']} finding(s); "
            "chrome://tracing reads it too")


def _said_proto(st: dict) -> str:
    return (f"{st['bytes'] / 1e6:.2f} MB Perfetto protobuf: {st['slices']:,} slices, {st['instants']:,} instants, "
            f"{st['flows']} KV flow(s), {st['findings']} finding(s)")


def _check_extras(proto: bool, parquet: bool) -> None:
    """Every missing optional package in one line, before anything is read or written."""
    import importlib.util

    missing = []
    if proto and importlib.util.find_spec("perfetto") is None:
        missing.append(("perfetto", "the perfetto package"))
    if parquet and importlib.util.find_spec("pyarrow") is None:
        missing.append(("parquet", "pyarrow"))
    if missing:
        extras = ",".join(x for x, _ in missing)
        raise PdtraceError(f"this export needs {' and '.join(w for _, w in missing)}: pip install 'pdtrace[{extras}]'")

