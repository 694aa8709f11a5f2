"""`pdtrace export TRACE --perfetto out.json`: Chrome / Perfetto trace-event JSON."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import PdtraceError


def run(trace: Path, perfetto: Path, lenient: bool = False) -> int:
    from ..viewers import perfetto as pf
    from .report import load_with_findings

    tr, findings, note = load_with_findings(Path(trace), lenient)
    try:
        stats = pf.write(tr, perfetto, findings)
    except OSError as exc:
        raise PdtraceError(f"cannot write {perfetto}: {exc.strerror or exc}") from None
    print(f"wrote {perfetto} ({stats['events']:,} trace events, {stats['flows']} KV flow(s), "
          f"{stats['findings']} finding(s)); open it in https://ui.perfetto.dev or chrome://tracing", file=sys.stderr)
    if note:
        print(f"pdtrace: warning: {note}", file=sys.stderr)
    return 0
