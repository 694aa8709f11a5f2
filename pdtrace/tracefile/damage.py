"""What a damaged or incomplete trace lacks, in words: damaged lines a lenient read skipped,
a cut recording (no footer), a cut or corrupt ``.zst`` stream, and what the footer says was
lost when the trace was written (a merge of damaged inputs, damaged shard frames). The same
wording in check, report, export, info and the viewer; coverage turns it into "not checked"."""

from __future__ import annotations

import sys
from typing import Any

from .compress import CUT_STREAM, stream_damage
from .zsource import is_gap


def _reason(p: Any) -> str:
    return str(getattr(p, "reason", p))


def damaged_lines(problems: Any) -> int:
    """How many of a load's problems are damaged lines: not the missing footer (a problem
    of its own, said separately), so a cut trace does not read as one more damaged line,
    nor a compressed stream that stops being readable (said separately too)."""
    if isinstance(problems, int):
        return problems
    return sum(1 for p in problems if not _reason(p).startswith("no footer") and not stream_damage(_reason(p))
               and not is_gap(_reason(p)))


def incomplete_reason(footer: dict | None, problems: Any) -> str | None:
    """Why a loaded trace is not whole, in words, or None when it is (footer present, no damage).
    ``problems``: the load's problem list (or a count of damaged lines)."""
    bits = []
    stopped = None if isinstance(problems, int) else next((p for p in problems if stream_damage(_reason(p))), None)
    gaps = [] if isinstance(problems, int) else [p for p in problems if is_gap(_reason(p))]
    no_footer = not isinstance(problems, int) and any(_reason(p).startswith("no footer") for p in problems)
    lines = damaged_lines(problems)
    if lines:
        bits.append(f"{lines} damaged line(s) skipped")
    if gaps:  # damaged frames of a seekable .zst, skipped: the lines after them were read
        more = f" (+{len(gaps) - 1} more gap(s))" if len(gaps) > 1 else ""
        after = "" if footer is None and not no_footer else "; the lines after it were read"  # (or it took the footer)
        bits.append(f"the compressed file is damaged at line {gaps[0].line}: {_reason(gaps[0]).split(';')[0]}{more}"
                    f"{after}")
    if stopped is not None:  # a damaged .zst: its footer may be there, unread (not a cut recording)
        where = f" at line {stopped.line}" if getattr(stopped, "line", 0) else ""
        if _reason(stopped).startswith(CUT_STREAM):
            bits.append(f"the compressed file was cut{where}, inside a zstd frame")
        else:
            bits.append(f"the compressed file is damaged{where}: the lines after it were not read")
    elif footer is None and (not gaps or no_footer):  # (a gap at the end took the footer: said by the gap)
        bits.append("no footer: the recording was cut off")
    elif footer is not None:
        bits.extend(footer_damage(footer))
    return "; ".join(bits) or None


def footer_damage(footer: dict) -> list[str]:
    """What a footer says its trace lost when it was written: a merge of damaged inputs
    (``input_problems``, read with --lenient), a recording with damaged shard frames
    (``shard_problems``, ``lost``). The events are whole lines, but some never made it."""
    out = []
    if footer.get("input_problems"):
        out.append(f"merged from damaged input(s): {len(footer['input_problems'])} problem line(s) "
                   f"({footer['input_problems'][0]})")
    if footer.get("shard_problems"):
        lost = footer.get("lost") or 0
        out.append(f"{len(footer['shard_problems'])} damaged shard stretch(es) skipped while recording"
                   + (f", {lost} event(s) lost" if lost else ""))
    return out


def warn_problems(tr: "object", limit: int = 20, incomplete: bool = True) -> None:
    """One stderr line per damaged line a lenient load skipped (the first ``limit``), and
    one when the trace is incomplete: the same wording in check, report, export and info."""
    problems = getattr(tr, "problems", ()) or ()
    path = getattr(tr, "path", "")
    for p in problems[:limit]:
        print(f"pdtrace: warning: {path}:{p.line}: {p.reason}", file=sys.stderr)
    if len(problems) > limit:
        print(f"pdtrace: warning: ... and {len(problems) - limit} more problem line(s)", file=sys.stderr)
    if incomplete and (problems or getattr(tr, "footer", None) is None):
        why = incomplete_reason(getattr(tr, "footer", None), problems)
        print(f"pdtrace: warning: {path}: incomplete trace ({why}): read with --lenient; what it lacks is not "
              f"checked", file=sys.stderr)
