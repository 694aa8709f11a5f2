"""`pdtrace check`: run the detectors over a trace.

The trace is streamed (``pdtrace.detectors.stream``): read in segments that the detectors
consume and let go, so memory is their live state, not the trace's length; ``--what-if``'s
replay is fed the same segments. With ``-j N`` (by default 2 for a big trace) the detectors
are split over processes by the kinds they read (``pdtrace.detectors.parallel``), with the
same result. Flight-recorder traces (``ring_s``) are loaded whole.

Exit codes: 0 no findings and every selected bug class checked, 1 at least one finding
(error or warning), 2 unusable trace or bad arguments (``PdtraceError``), 4 no findings but
at least one bug class not checked (its events are missing, a hook feeding it raised, a
process emitting them dropped events, or the trace is incomplete: damaged lines skipped by
``--lenient`` or no footer; ``EXIT_NOT_CHECKED``), also when the only findings are
``inconclusive`` (the trace lacks what would decide them, e.g. a token count). Every format states, per bug
class, whether it was checked, does not apply to the recorded configuration, or was not
checked and why (``pdtrace.detectors.coverage``). Formats:

- ``text``: for a terminal: the verdict and the root causes first (findings that share a class,
  a mechanism and vLLM's code path are one cause, with vLLM's file:line and the upstream
  issues), then coverage, then each cause's first findings in full (``--cause N``: all of one).
- ``markdown``: ready to paste into a GitHub issue: each cause with one worked example, links
  to vLLM's source at the recorded release's tag, the commands that reproduce it; the finding
  table and coverage under <details>; environment: pdtrace / vLLM / torch / nixl versions and
  the trace origin.
- ``json``: a stable machine-readable shape::

    {
      "schema": "pdtrace-check", "version": 1,
      "trace": {"path": str, "origin": str, "created": str, "host": str,
                "versions": {"pdtrace", "vllm", "torch", "nixl", "python": str},
                "events": int, "complete": bool,
                "problems": [{"line": int, "reason": str}]},
      "detectors": [kind, ...],                 # detectors that ran
      "request": str | null,                    # --request filter
      "request_other_side": [str, ...],         # the other side of its P/D pair (its findings are listed too)
      "summary": {"findings": int, "errors": int, "warnings": int, "inconclusive": int, "by_kind": {kind: int},
                  "not_checked": [kind, ...]},
      "coverage": {kind: {"kind", "status": "checked" | "not-applicable" | "not-checked",
                          "reason": str, "events": int, "hook_errors": {hook: int}}},
      "causes": [{"n", "kind", "mechanism", "title", "severity",   # root causes (pdtrace.detectors.causes):
                  "findings": [int, ...],        # indices into "findings"
                  "errors", "warnings", "inconclusive": int, "requests": [str], "steps": [first, last],
                  "instances": [str], "upstream": [url],
                  "where": [{"hook", "function", "file", "line", "source", "url"}],  # in vLLM, at its tag
                  "first": {"index", "req", "step"}}, ...],   # errors first, then by size
      "findings": [{"kind", "severity", "req", "step", "inst", "event_ids", "title",
                    "explanation", "data", "cause": int}, ...],   # sorted by (step, kind); text and
                                                # markdown list errors, then warnings, then inconclusive
      "what_if": {"rule": str, "requests": [...]}   # only with --what-if (see pdtrace.detectors.whatif)
    }

  Fields may be added within version 1; none is removed or renamed.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson

from .. import __version__
from ..detectors import DETECTORS, Finding, by_severity, unknown_kinds
from ..detectors.base import KV_INVARIANT, SEVERITY_INCONCLUSIVE
from ..detectors import parallel, stream
from ..detectors.causes import group
from ..detectors.checking import check_file
from ..detectors.coverage import Coverage, coverage, not_checked
from ..errors import EXIT_FINDINGS, EXIT_NOT_CHECKED, EXIT_OK, PdtraceError, check_writable, write_stdout
from ..tracefile.damage import incomplete_reason, warn_problems
from ..tracefile.trace import Trace
from . import check_causes, check_notes
from .check_request import resolve_request
from .progress import load_progress

FORMATS = ("text", "markdown", "json")
JSON_SCHEMA = "pdtrace-check"
JSON_VERSION = 1


def run(trace: Path | str, format: str = "text", only: list[str] | None = None, request: str | None = None,
        what_if: str | None = None, output: Path | str | None = None, lenient: bool = False,
        jobs: int = 0, cause: int | None = None) -> int:
    from ..detectors import whatif as _whatif

    if format not in FORMATS:
        raise PdtraceError(f"unknown --format {format!r}; valid: {', '.join(FORMATS)}")
    if jobs < 0:
        raise PdtraceError(f"--jobs must be 0 (auto) or more, not {jobs}")
    only = list(only or [])
    bad = unknown_kinds(only)
    if bad:
        raise PdtraceError(f"unknown detector kind(s) for --only: {', '.join(bad)}; valid kinds: "
                           f"{', '.join(DETECTORS)}")
    if what_if is not None and what_if not in _whatif.RULES:
        raise PdtraceError(f"unknown --what-if rule {what_if!r}; valid: {', '.join(_whatif.RULES)}")

    if output is not None:
        check_writable(Path(output))
    ran = only or list(DETECTORS)
    checked = check_file(str(trace), only=only, request=request, lenient=lenient, what_if=what_if,
                         progress=load_progress(str(trace), verb="checking"),
                         jobs=jobs or parallel.auto_jobs(str(trace)))
    tr: Any = checked.trace
    if not checked.request_seen:  # the client's id or a prefix: the one request it names, checked again
        request = resolve_request(tr.path, request or "", checked.requests)
        checked = check_file(str(trace), only=only, request=request, lenient=lenient, what_if=what_if,
                             jobs=jobs or parallel.auto_jobs(str(trace)))
        tr = checked.trace
    warn_problems(tr)
    findings, cov, wi = checked.findings, checked.coverage, checked.replay
    pair = checked.pair
    causes = group(by_severity(findings), checked.where)
    if cause is not None and not 1 <= cause <= len(causes):
        raise PdtraceError(f"{tr.path}: no cause {cause}: " + (f"the trace's findings have {len(causes)} root "
                                                              f"cause(s), 1 to {len(causes)}" if causes else
                                                              "the trace has no findings"))
    if cause is not None:  # one cause's findings (and the counts, coverage and causes as they were)
        ordered = by_severity(findings)  # (the order the causes' indices refer to, sorted once)
        keep = {id(ordered[i]) for i in causes[cause - 1].findings}
        findings = [f for f in findings if id(f) in keep]
    flags = dict(lenient=lenient, request=request, only=only)
    if format == "json":
        text = render_json(tr, findings, ran, request, what_if, wi, cov=cov, notes=checked.notes, pair=pair,
                           where=checked.where, cause=cause)
    elif format == "markdown":
        text = render_markdown(tr, findings, ran, request, cov=cov, notes=checked.notes, pair=pair,
                               where=checked.where, cause=cause,
                               again=check_causes.again(os.path.basename(str(trace)), **flags))
        if wi is not None:
            text += "\n" + _whatif.render_markdown(wi)
    else:
        width = text_width() if output is None else None
        text = render_text(tr, findings, ran, request, cov=cov, width=width, notes=checked.notes, pair=pair,
                           where=checked.where, cause=cause, again=check_causes.again(str(trace), **flags))
        if wi is not None:
            wi_text = _whatif.render_text(wi)
            text += "\n" + (wi_text if width is None else _wrap_block(wi_text, width))
    if output is not None:
        Path(output).write_text(text, encoding="utf-8")
        print(f"pdtrace: wrote {output}", file=sys.stderr)
    else:
        write_stdout(text)
        if format == "text" and sys.stdout.isatty():
            _next_steps(str(trace), findings, cov)
    return exit_code(findings, cov)


def _next_steps(trace: str, findings: list[Finding], cov: dict[str, Coverage]) -> None:
    """What to do next, for a person at a terminal (stderr; never in piped or written reports)."""
    tips = []
    if findings:
        tips += [f"pdtrace view {trace}   (f: next finding)", f"pdtrace report {trace} -o report.html",
                 f"pdtrace bundle {trace} -o bug.tar.gz   (for a bug report)"]
    if not_checked(cov):
        tips.append("pdtrace doctor   (which hooks feed each class on the vLLM installed here)")
    if tips:
        w = text_width() or 100
        lines = [ln for i, t in enumerate(tips) for ln in _wrap(t, w, "next: " if i == 0 else "      ", "        ")]
        print("\n".join(lines), file=sys.stderr)


def exit_code(findings: list[Finding], cov: dict[str, Coverage]) -> int:
    """1 with findings (errors / warnings); else 4 when some class was not checked or a finding
    is inconclusive (the trace lacks what would decide it); else 0."""
    if any(f.severity != SEVERITY_INCONCLUSIVE for f in findings):
        return EXIT_FINDINGS
    if findings:
        return EXIT_NOT_CHECKED
    return EXIT_NOT_CHECKED if not_checked(cov) else EXIT_OK


# ---------------------------------------------------------------------------------------
# renderers (also used by `bundle` / `demo`)
# ---------------------------------------------------------------------------------------

def _versions(tr: Trace) -> dict[str, str]:
    v = dict(tr.header.get("versions") or {})
    v.setdefault("pdtrace", tr.header.get("pdtrace", ""))
    return {k: v.get(k, "") or "" for k in ("pdtrace", "vllm", "torch", "nixl", "python")}


def _counts(findings: list[Finding], cov: dict[str, Coverage] | None = None) -> dict[str, Any]:
    by_kind: dict[str, int] = {}
    for f in findings:
        by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
    return {"findings": len(findings), "errors": sum(f.severity == "error" for f in findings),
            "warnings": sum(f.severity == "warning" for f in findings),
            "inconclusive": sum(f.severity == SEVERITY_INCONCLUSIVE for f in findings), "by_kind": by_kind,
            "not_checked": not_checked(cov or {})}


def _cov(tr: Trace, ran: list[str], cov: dict[str, Coverage] | None) -> dict[str, Coverage]:
    return cov if cov is not None else coverage(tr.events, tr.header, tr.footer, kinds=ran,
                                                incomplete=incomplete_reason(tr.footer, tr.problems))


def render_json(tr: Trace, findings: list[Finding], ran: list[str], request: str | None = None,
                what_if: str | None = None, wi: list | None = None,
                cov: dict[str, Coverage] | None = None, notes: dict[str, list] | None = None,
                pair: list[str] | None = None, where: dict | None = None, cause: int | None = None) -> str:
    cov = _cov(tr, ran, cov)
    h = tr.header
    causes = _numbered(group(findings, where), cause)  # (indices into "findings", in its (step, kind) order)
    of = check_causes.cause_of(causes)
    doc: dict[str, Any] = {
        "schema": JSON_SCHEMA, "version": JSON_VERSION,
        "trace": {"path": str(tr.path), "origin": h.get("origin", ""), "created": h.get("created", ""),
                  "host": h.get("host", ""), "versions": _versions(tr), "events": tr.n_events,
                  "complete": tr.complete,
                  "problems": [{"line": p.line, "reason": p.reason} for p in tr.problems]},
        "detectors": list(ran), "request": request, "request_other_side": list(pair or []),
        "summary": _counts(findings, cov),
        "coverage": {k: c.to_dict() for k, c in cov.items()},
        "causes": check_causes.json_causes(causes, _versions(tr)["vllm"]),
        "findings": [{**f.to_dict(), "cause": of[i].n} for i, f in enumerate(findings)],
        "kv_load": check_notes.kv_load_notes(notes or {}),
        "kv_crossing": check_notes.crossing_notes(notes or {}),
        "kv_invariant": ((notes or {}).get(KV_INVARIANT) or [{}])[0],
    }
    if what_if is not None:
        doc["what_if"] = {"rule": what_if, "requests": wi or []}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n"


def _numbered(causes: list, cause: int | None) -> list:
    """--cause N: the one cause left keeps its number."""
    if cause is not None and len(causes) == 1:
        causes[0].n = cause
    return causes


def _summary_line(findings: list[Finding], cov: dict[str, Coverage] | None = None) -> str:
    c = _counts(findings, cov)
    nc = c["not_checked"]
    tail = f"; {len(nc)} bug class(es) not checked" if nc else ""
    if not c["findings"]:
        return ("no findings in the classes checked" if nc else "no findings") + tail
    inc = f", {c['inconclusive']} inconclusive" if c["inconclusive"] else ""
    nc_ = len(group(findings))
    return (f"{c['findings']} finding(s): {c['errors']} error(s), {c['warnings']} warning(s){inc}; "
            f"{nc_} root cause{'s' if nc_ != 1 else ''}" + tail)


_NBSP = "\u00a0"  # textwrap does not break there


def _wrap(text: str, width: int, indent: str, hang: str | None = None) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=hang or indent,
                         break_on_hyphens=False) or [indent]


def _wrap_block(text: str, width: int) -> str:
    """Each line of ``text`` wrapped at ``width``, its continuation lines under its own indent
    plus four spaces (the --what-if report at a terminal)."""
    out = []
    for line in text.splitlines():
        indent = line[:len(line) - len(line.lstrip())]
        out += _wrap(line, width, indent, indent + "    ")
    return "\n".join(out) + "\n"


def text_width() -> int | None:
    """The text report's width: the terminal's (60 to 100 columns) when stdout is one, or
    ``COLUMNS`` when set; else None: piped or captured, one line per coverage verdict (for grep)."""
    if not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit():
        return None
    return max(60, min(100, shutil.get_terminal_size((100, 24)).columns))


def _asked(request: str, pair: list[str] | None, q: str = "") -> str:
    """The --request filter as reports echo it, with the other side of its P/D pair."""
    if not pair:
        return f"{q}{request}{q}"
    return f"{q}{request}{q} and the other side of its P/D pair, {', '.join(q + p + q for p in pair)}"


def render_text(tr: Trace, findings: list[Finding], ran: list[str], request: str | None = None,
                cov: dict[str, Coverage] | None = None, width: int | None = None,
                notes: dict[str, list] | None = None, pair: list[str] | None = None, where: dict | None = None,
                cause: int | None = None, again: str | None = None) -> str:
    """The text report: every line wrapped at ``width`` columns (``text_width()``: a
    terminal); with None (piped, written to a file), the explanations at 100 columns and
    each header and coverage line whole. First the verdict and the root causes (at 80 columns
    the first screen), then coverage, then each cause's first ``PER_CAUSE`` findings in full
    (all of them with ``cause``: --cause N)."""
    whole, width = width is None, width or 100

    def line(text: str, w: int, indent: str, hang: str | None = None) -> list[str]:
        return [indent + text] if whole else _wrap(text, w, indent, hang)  # whole: the lines scripts grep

    cov = _cov(tr, ran, cov)
    v = _versions(tr)
    out = line(f"pdtrace check {tr.path}", width, "", "    ")
    out += line(f"origin {tr.header.get('origin', '?')}, {tr.n_events} events, vLLM {v['vllm'] or '?'}, "
                f"torch {v['torch'] or '?'}, nixl {v['nixl'] or '-'}, written by pdtrace {v['pdtrace'] or '?'}"
                + ("" if tr.complete else "  [INCOMPLETE: " + (incomplete_reason(tr.footer, tr.problems) or "?") + "]"),
                width, "  ", "    ")
    fault = check_notes.faults_line(tr.footer)
    out += line(fault, width, "  ", "    ") if fault else []
    insts = tr.header.get("instances") or []
    if insts:  # the "inst" of each finding below (record --instance, or P / D from vLLM's kv_role)
        out += line(f"instances: {', '.join(map(str, insts))} (`pdtrace record --instance`, or P / D from vLLM's "
                    f"kv_role)", width, "  ", "    ")
    said = f"all {len(DETECTORS)}" if set(ran) == set(DETECTORS) else ", ".join(ran)  # (the coverage lines name each class)
    out += line(f"detectors: {said}" + (f"; request {_asked(request, pair)}" if request else ""),
                width, "  ", "    ")
    ordered = by_severity(findings)
    causes = _numbered(group(ordered, where), cause)
    out += ["", *line(_summary_line(findings, cov), width, "", "  ")]
    if cause is not None:
        out += line(f"(--cause {cause}: only its findings)", width, "", "  ")
    out += check_causes.text_lines(causes, again or check_causes.again(str(tr.path)), line, width, asked=cause)
    out += ["", "coverage:"]
    kw = max((len(k) for k in cov), default=0)
    if cause is not None:  # (its findings, not the verdicts again: those are in the whole report)
        n = {st: sum(c.status == st for c in cov.values()) for st in ("checked", "not-applicable", "not-checked")}
        out += line(f"{n['checked']} class(es) checked, {n['not-applicable']} do not apply, {n['not-checked']} not "
                    f"checked (without --cause the report says why)", width, "  ", "    ")
        cov = {}
    for k, c in cov.items():
        if whole or 2 + kw + 2 + 30 <= width:  # the verdict in a column beside the class
            out += line(f"{k:<{kw}}  {c.line()}", width, "  ", " " * (2 + kw + 2))
        else:  # too narrow for the column: the verdict under the class
            out += ["  " + k] + _wrap(c.line(), width, "      ")
    cross = check_notes.crossing_lines(notes or {})
    out += ["", *line(check_notes.CROSSING, width, "", "  ")] if cross else []
    for x, depth in cross:
        out += line(x, width, "  " * (depth + 1), "  " * (depth + 2))
    kv_title = check_notes.title(notes or {})
    if kv_title:
        out += ["", *line(kv_title, width, "", "  ")]
        for head, words in check_notes.text_lines(notes or {}):
            out += line(head, width, "  ", "    ") + line(words, width, "    ", "      ")
    shown = _shown(causes, cause)
    of = check_causes.cause_of(causes)
    for n, f in enumerate(ordered, 1):
        if n - 1 not in shown:
            continue
        at = " ".join(x for x in (f"step{_NBSP}{f.step}" if f.step is not None else "",
                                      f"inst{_NBSP}{f.inst}" if f.inst else "", f"req{_NBSP}{f.req}" if f.req else "") if x)
        out.append("")
        # (a label and its value are never split over two lines: "req" / "req-10-D")
        out += [x.replace(_NBSP, " ") for x in line(f"[{n}] {f.severity.upper()} {f.kind}  {at}", width, "", "    ")]
        out += line(f.title + (f"  (cause {of[n - 1].n})" if len(causes) > 1 else ""), width, "    ")
        out += _wrap(f.explanation, width, "    ")
        ids = f.event_ids[:12]
        out.append(f"    events: {ids}" + (f" (+{len(f.event_ids) - 12})" if len(f.event_ids) > 12 else ""))
    hidden = [(c, len(c.findings) - len([i for i in c.findings if i in shown])) for c in causes]
    for c, k in hidden:
        if k:
            out += ["", *line(f"(+{k} more finding(s) of cause {c.n}: {again or check_causes.again(str(tr.path))} "
                              f"--cause {c.n}, or "
                              f"--format json)", width, "", "  ")]
    if len(shown) > 3:  # a long list scrolls the counts away: say them again where the terminal stops
        out += ["", *line(_summary_line(findings, cov) + " (listed above, errors first)", width, "", "  ")]
    return "\n".join(out) + "\n"


PER_CAUSE = 3  # findings listed in full per cause (all of one with --cause N)


def _shown(causes: list, cause: int | None) -> set[int]:
    if cause is not None:
        return {i for c in causes for i in c.findings}
    return {i for c in causes for i in sorted(c.findings)[:PER_CAUSE]}


MD_ROWS = 20  # markdown: findings in the table (a GitHub issue body holds 65,536 characters)


def _md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(tr: Trace, findings: list[Finding], ran: list[str], request: str | None = None,
                    cov: dict[str, Coverage] | None = None, notes: dict[str, list] | None = None,
                    pair: list[str] | None = None, where: dict | None = None, cause: int | None = None,
                    again: str | None = None) -> str:
    """For a GitHub issue: the verdict, each root cause with one worked example, where in vLLM
    (links at the recorded release's tag) and upstream, the commands that reproduce the check;
    the findings table (``MD_ROWS`` rows) and coverage under <details>, then the environment."""
    cov = _cov(tr, ran, cov)
    v = _versions(tr)
    h = tr.header
    out = [f"## pdtrace check: {_summary_line(findings, cov)}", ""]
    if request:  # (a pasted issue must not read as the whole trace's count)
        out += [f"Only the findings about request {_asked(request, pair, '`')}.", ""]
    if cause is not None:
        out += [f"Only the findings of cause {cause} (`--cause {cause}`).", ""]
    if findings:
        findings = by_severity(findings)
        causes = _numbered(group(findings, where), cause)
        of = check_causes.cause_of(causes)
        # (the file's own name: a pasted issue carries no local path; a bundle holds the trace by that name)
        out += check_causes.markdown(causes, findings, again or check_causes.again(os.path.basename(str(tr.path))),
                                     h, v, v["vllm"])
        out += [f"<details><summary>All {len(findings)} finding(s)"
                + (f" (the first {MD_ROWS} here; all: <code>pdtrace check --format json</code>)"
                   if len(findings) > MD_ROWS else "") + "</summary>", "",
                "| # | cause | severity | step | instance | request | summary |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for n, f in enumerate(findings[:MD_ROWS], 1):
            out.append(f"| {n} | {of[n - 1].n} | {f.severity} | {'' if f.step is None else f.step} | "
                       f"{f.inst or ''} | {('`' + _md_escape(f.req) + '`') if f.req else ''} | "
                       f"{_md_escape(check_causes.short(check_causes.untagged(f)))} |")
        out += ["", "</details>", ""]
    else:
        out += [f"No findings from: {', '.join(f'`{k}`' for k in ran)}.", ""]
    folded = not not_checked(cov)  # (a class not checked stays in sight)
    out += ["### Coverage", ""]
    out += (["<details><summary>" + ", ".join(f"{k} {c.status}" for k, c in cov.items()) + "</summary>", ""]
            if folded else [])
    out += ["| bug class | verdict |", "| --- | --- |"]
    out += [f"| `{k}` | {_md_escape(c.line())} |" for k, c in cov.items()]
    out += ["", "</details>"] if folded else []
    kv_md = check_notes.markdown(notes or {})
    if kv_md:
        out += ["", *kv_md[:-1]]
    out += ["", "### Environment", "",
            "| | |", "| --- | --- |",
            f"| pdtrace (check) | {__version__} |",
            f"| pdtrace (recorded) | {v['pdtrace'] or 'unknown'} |",
            f"| vLLM | {v['vllm'] or 'unknown'} |",
            f"| torch | {v['torch'] or 'unknown'} |",
            f"| nixl | {v['nixl'] or 'not installed'} |",
            f"| python | {v['python'] or 'unknown'} |",
            f"| trace origin | {h.get('origin', 'unknown')} |",
            f"| trace created | {h.get('created', '')} |",
            f"| events | {tr.n_events}{'' if tr.complete else f' (incomplete: {len(tr.problems)} problem line(s))'} |",
            f"| instances | {', '.join(h.get('instances') or []) or '-'} |",
            f"| detectors | {', '.join(ran)} |"]
    if request:
        out.append(f"| request filter | {_asked(request, pair, '`')} |")
    out.append("")
    return "\n".join(out) + "\n"
