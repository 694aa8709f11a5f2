"""`pdtrace info`: summarize a trace (header, versions, origin, processes, counts, drops, hooks)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import EXIT_OK
from ..trace import load, make_footer
from ..progress import load_progress


def run(trace: Path | str, lenient: bool = False) -> int:
    tr = load(str(trace), lenient=lenient, progress=load_progress(str(trace)))
    for p in tr.problems[:20]:
        print(f"pdtrace: warning: {tr.path}:{p.line}: {p.reason}", file=sys.stderr)
    h = tr.header
    footer = tr.footer
    derived = footer is None
    if footer is None:  # lenient read of a cut trace: rebuild the summary from the events
        footer = make_footer(tr.events)
    v = h.get("versions") or {}
    out = [f"trace      {tr.path}",
           f"schema     {h.get('schema')} v{h.get('schema_version')}, written by pdtrace {h.get('pdtrace', '?')}",
           f"origin     {h.get('origin', '?')}" + (f"   instances {', '.join(h['instances'])}" if h.get("instances") else ""),
           f"created    {h.get('created', '?')} on {h.get('host', '?')}   redacted {h.get('redacted')}",
           "versions   " + ", ".join(f"{k} {v.get(k) or '-'}" for k in ("vllm", "torch", "nixl", "python")),
           f"command    {' '.join(h.get('cmd') or []) or '-'}",
           f"complete   {'yes' if tr.complete else 'NO'}" + (" (summary rebuilt from the events: no footer)" if derived else "")
           + (f", {len(tr.problems)} problem line(s)" if tr.problems else "")
           + (f", exit code {footer['exit_code']}" if footer.get("exit_code") is not None else "")]
    out.append(f"events     {len(tr.events)}" + (f" (footer says {footer.get('events')})"
                                                  if not derived and footer.get("events") != len(tr.events) else ""))
    out.append(f"dropped    {footer.get('dropped', 0)}" + (f"   lost {footer['lost']} (damaged shard frames)"
                                                              if footer.get("lost") else ""))
    procs = footer.get("processes") or []
    out.append(f"processes  {len(procs)}")
    for p in procs:
        out.append(f"  pid {p.get('pid'):>7}  {p.get('role', '?'):<12} inst {p.get('inst', '?'):<3} "
                   f"events {p.get('events', 0):>8}  dropped {p.get('dropped', 0)}"
                   + ("" if p.get("complete", True) else "  (ended without proc.exit)"))
    counts = footer.get("counts") or {}
    out.append("event counts")
    for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        out.append(f"  {n:>9}  {k}")
    errs = footer.get("hook_errors") or {}
    out.append("hook errors " + ("none" if not errs else ""))
    for k, n in sorted(errs.items()):
        out.append(f"  {n:>9}  {k}")
    hooks = footer.get("hooks") or {}
    applied = hooks.get("applied") or []
    skipped = hooks.get("skipped") or {}
    out.append(f"hooks      {len(applied)} applied, {len(skipped)} skipped")
    if applied:
        out.append("  applied: " + ", ".join(applied))
    for k, why in sorted(skipped.items()):
        out.append(f"  skipped {k}: {why}")
    print("\n".join(out))
    return EXIT_OK
