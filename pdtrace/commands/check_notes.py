"""The facts ``pdtrace check`` prints beside its findings: per request a failed KV load touched,
what the scheduler decided and what followed (``detectors.kv_load.Stream.notes``). Facts, not
verdicts: they change no exit code; a wrong recovery is a finding of its own."""

from __future__ import annotations

from typing import Any

from ..detectors.base import KV_LOAD_FAILURE_RECOVERY, KV_NEVER_CROSSED
from ..detectors import crossed_groups
from ..detectors.crossed import summary_line
from ..detectors.kv_load import describe

SHOWN = 20  # requests listed in text and markdown; JSON lists them all


def faults_line(footer: dict | None) -> str | None:
    """Where the trace carries labelled faults (``fault.inject`` events, written by pdtrace's harness where it plants
    an old rule or a fault on purpose), one line that says so: its findings are the fault's, not what vLLM does as
    released, however vLLM's code is named below."""
    n = int(((footer or {}).get("counts") or {}).get("fault.inject") or 0)
    if not n:
        return None
    return (f"LABELLED FAULT: {n} fault.inject event(s), planted on purpose (the sample's provenance says which): "
            f"its findings are the fault's, not vLLM's as released")


def kv_load_notes(notes: dict[str, list]) -> list[dict[str, Any]]:
    return list(notes.get(KV_LOAD_FAILURE_RECOVERY) or [])


def text_lines(notes: dict[str, list]) -> list[tuple[str, str]]:
    """(head, words) per request: ``head`` the instance and request, ``words`` ``describe``'s."""
    kv = kv_load_notes(notes)
    return [(f"{n.get('inst') or '-'} {_req(n)}", describe(n)) for n in kv[:SHOWN]]


def _req(n: dict) -> str:
    """The request a fact is about, or what the trace says instead (never "None")."""
    return str(n["req"]) if n.get("req") is not None else "(the failed load's request is not in the trace)"


def title(notes: dict[str, list]) -> str | None:
    kv = kv_load_notes(notes)
    if not kv:
        return None
    more = f"; the first {SHOWN} listed, --format json has all" if len(kv) > SHOWN else ""
    return f"KV load failures: {len(kv)} request(s) ({KV_LOAD_FAILURE_RECOVERY}: what happened, facts{more})"


def crossing_notes(notes: dict[str, list]) -> list[dict[str, Any]]:
    return list(notes.get(KV_NEVER_CROSSED) or [])


CROSSING = f"Where D's prompt tokens came from ({KV_NEVER_CROSSED}: per instance pair, facts)"


def crossing_lines(notes: dict[str, list]) -> list[tuple[str, int]]:
    """(line, depth): one line per instance pair (``detectors.crossed.summary_line``: loaded from P,
    D's own prefix cache, computed on D), and under it (depth 1) where its KV cache groups differ in
    what reached them (``detectors.crossed_groups.lines``)."""
    out = []
    for n in crossing_notes(notes):
        out.append((summary_line(n), 0))
        out += [(x, 1) for x in crossed_groups.lines(n.get("groups") or [])]
    return out


def markdown(notes: dict[str, list]) -> list[str]:
    out = []
    cross = crossing_lines(notes)
    if cross:
        out += [f"### {CROSSING}", "", *(f"{'  ' * d}- {x}" for x, d in cross), ""]
    t = title(notes)
    if t is None:
        return out
    out += [f"### {t}", "", "| instance | request | what happened |", "| --- | --- | --- |"]
    for n in kv_load_notes(notes)[:SHOWN]:
        out.append(f"| {n.get('inst') or ''} | `{_req(n).replace('|', chr(92) + '|')}` | {describe(n)} |")
    return out + [""]
