"""`pdtrace info`: summarize a trace (header, versions, origin, processes, counts, drops, hooks)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from .. import schema
from ..errors import EXIT_OK, write_stdout
from ..tracefile.damage import footer_damage, warn_problems
from ..tracefile.footer import FooterCounter
from ..tracefile.reading import Rescan, Sink, read_through
from ..tracefile.trace import is_complete
from ..tracefile.ends import read_ends
from .progress import load_progress


def run(trace: Path | str, lenient: bool = False, full: bool = False) -> int:
    quick = None
    if not full and not lenient:
        header, footer, size = read_ends(str(trace))
        if footer is not None and header["schema_version"] <= schema.SCHEMA_VERSION:
            quick = (header, footer)  # (a newer schema: the full read below refuses it, as check does)
    if quick is not None:  # constant time: the events are not read
        h, footer = quick
        derived, problems, n_events, path = False, [], footer["events"], str(trace)
        complete = ("yes (footer intact; the events were not read: --full reads them, "
                    "`pdtrace check` checks them)")
        damage = footer_damage(footer)
        if damage:
            complete = "NO: " + "; ".join(damage)
    else:  # info is the command for looking at a damaged trace: it reads past damage (as --lenient)
        tr, counted = _read(str(trace), lenient or not _newer(str(trace)))  # (a newer schema: refused)
        warn_problems(tr, incomplete=False)  # info says whether it is complete itself
        h, footer, problems, n_events, path = tr.header, tr.footer, tr.problems, counted.n, tr.path
        derived = footer is None
        if footer is None:  # lenient read of a cut trace: rebuild the summary from the events
            footer = counted.footer()
        complete = ("yes" if is_complete(footer if not derived else None, problems) else "NO") + (
            " (summary rebuilt from the events: no footer)" if derived else "")
        damage = [] if derived else footer_damage(footer)
        if damage:
            complete = "NO: " + "; ".join(damage)
    v = h.get("versions") or {}
    out = [f"trace      {path}",
           f"schema     {h.get('schema')} v{h.get('schema_version')}, written by pdtrace {h.get('pdtrace', '?')}",
           f"origin     {h.get('origin', '?')}" + (f"   instances {', '.join(h['instances'])}" if h.get("instances") else ""),
           f"created    {h.get('created', '?')} on {h.get('host', '?')}   redacted {h.get('redacted')}",
           "versions   " + ", ".join(f"{k} {v.get(k) or '-'}" for k in ("vllm", "torch", "nixl", "python")),
           *_commands(h),
           f"complete   {complete}"
           + (f", {len(problems)} problem line(s)" if problems else "")
           + (f", exit code {footer['exit_code']}" if footer.get("exit_code") is not None else "")]
    out.append(f"events     {n_events}" + (f" (footer says {footer.get('events')})"
                                              if not derived and footer.get("events") != n_events else ""))
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
    if sys.stdout.isatty():  # at a terminal, long lines (commands, hook lists) wrap under their label
        import shutil
        import textwrap
        w = max(60, shutil.get_terminal_size((100, 24)).columns)
        out = [ln for line in out for ln in (textwrap.wrap(line, w, subsequent_indent=" " * 11, break_on_hyphens=False)
                                             if len(line) > w else [line])]
    write_stdout("\n".join(out) + "\n")
    return EXIT_OK


def _newer(path: str) -> bool:
    """The trace's header says a schema newer than this pdtrace reads (refused as check refuses
    it, unless --lenient)."""
    from ..tracefile.trace import read_header

    try:
        return int(read_header(path).get("schema_version") or 0) > schema.SCHEMA_VERSION
    except Exception:  # noqa: BLE001 - an unreadable header: the read below says why, in one line
        return False


def _read(path: str, lenient: bool) -> tuple[Sink, FooterCounter]:
    """Read every event (``--full``, or no intact footer) in segments, counting them as a
    footer counts (memory bounded: nothing is kept); ``Sink``: header, footer, problems."""
    def start(fast: bool) -> tuple[Sink, Any]:
        into = Sink()  # (each pass its own: a second one, through scan, starts over)
        into.path = path  # type: ignore[attr-defined]
        into.counted = FooterCounter()  # type: ignore[attr-defined]
        add = into.counted.add  # type: ignore[attr-defined]

        def consume(seg: Any) -> None:
            try:
                for e in seg:
                    add(e)
            except (KeyError, TypeError):
                if fast:  # a value the fast path did not type-check (its digest is known at the end): scan decides
                    raise Rescan from None
                raise
        return into, consume

    was_enabled = gc.isenabled()
    gc.disable()  # (as stream.run: a segment's garbage is freed by refcount, it holds no cycles)
    try:
        into = read_through(path, lenient, load_progress(path), start)
        return into, into.counted
    finally:
        if was_enabled:
            gc.enable()


def _commands(h: dict) -> list[str]:
    """The recorded command; for a merged trace, each input's."""
    merged = [m for m in (h.get("merged_from") or []) if isinstance(m, dict)]
    import shlex

    def say(cmd: Any) -> str:  # (quoted: it pastes into a shell)
        return " ".join(shlex.quote(str(x)) for x in (cmd or [])) or "-"
    if not any(m.get("cmd") for m in merged):
        return [f"command    {say(h.get('cmd'))}"]
    return [f"command    {m.get('trace', '?')}: {say(m.get('cmd'))}" if i == 0 else
            f"           {m.get('trace', '?')}: {say(m.get('cmd'))}"
            for i, m in enumerate(merged)]
