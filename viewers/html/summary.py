"""The report's text sections: the compact summary at the top (verdict, findings and
coverage per bug class, findings per request), the trace facts, and the findings table
whose rows select a finding and whose cited event ids link into the event table."""

from __future__ import annotations

import collections
import re
from typing import Any, Callable, Sequence

from pdtrace.detectors.coverage import CHECKED, NOT_CHECKED

from .causes_section import causes_html
from .common import FindingView, Model, esc, short
from .coverage_section import coverage_html, no_findings_line

MAX_LINKED_IDS = 24  # cited ids written as links per finding row; the rest: select the finding
MAX_REQUEST_ROWS = 20
MAX_FINDING_ROWS = 400  # findings listed (and selectable); the summary's counts cover all of them


def finding_link(k: int, text: str) -> str:
    """A count that selects finding k, or the bare count when k is past the listed ones."""
    if k >= MAX_FINDING_ROWS:
        return text
    return f'<a class="selfind" href="#finding-{k + 1}" data-finding="{k}">{text}</a>'


def ev_link(i: int) -> str:
    return f'<a class="evlink" href="#ev-{i}" data-ev="{i}">#{i}</a>'


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> '1–3, 5'."""
    out: list[str] = []
    for s in sorted(set(steps)):
        if out and isinstance(out[-1], list) and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in out)


def overview_html(m: Model, header: dict, footer: dict | None, events: list[dict], findings_note: str,
                  problems: Any = 0, cov: dict[str, Any] | None = None) -> str:
    """The compact summary: one verdict line, a per-class table (coverage verdict and
    findings) and a per-request table; every count links to the first finding it counts."""
    fs = m.findings
    first_of: dict[str, int] = {}
    per_class: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, f in enumerate(fs):
        first_of.setdefault(f.kind, i)
        per_class[f.kind][f.severity] += 1

    def cell(kind: str, cov: Any = None) -> str:
        c = per_class.get(kind)
        if not c:
            if cov is not None and cov.status == NOT_CHECKED:
                return '<span class="warn">— (not checked)</span>'
            if cov is not None and cov.status != CHECKED:
                return '<span class="note">—</span>'
            return '<span class="ok">0</span>'
        n = sum(c.values())
        sev = ", ".join(f"{v} {k}(s)" for k, v in sorted(c.items()))
        return finding_link(first_of[kind], f"<b>{n}</b>") + f' <span class="note">({esc(sev)})</span>'

    cov_table, unchecked = coverage_html(events, header, footer, findings_cell=cell, problems=problems, cov=cov)
    out = ['<section id="overview"><h2>Summary</h2>']
    if findings_note:
        out.append(f'<p class="warn">{esc(findings_note)}</p>')
    if not fs:
        out.append(no_findings_line(unchecked))
    else:
        n_err = sum(f.severity == "error" for f in fs)
        n_warn = sum(f.severity == "warning" for f in fs)
        n_inc = len(fs) - n_err - n_warn
        classes = len(per_class)
        out.append(f'<p class="verdict bad"><b>{len(fs)} finding(s)</b>: {n_err} error(s), {n_warn} '
                   f"warning(s)" + (f", {n_inc} inconclusive" if n_inc else "") + f" in {classes} bug class(es)"
                   + (f"; {len(unchecked)} class(es) not checked: {esc(', '.join(unchecked))}" if unchecked else "")
                   + ". Click a finding (or a count) to zoom every time axis to it and list its events.</p>")
        out.append(causes_html(fs, events, header, finding_link))
    out.append('<div class="cols"><div>' + cov_table)
    other = sorted(set(per_class) - _covered_kinds(cov_table))
    if other:
        out.append('<p class="note">findings of other kinds: '
                   + ", ".join(f"{esc(k)}: {cell(k)}" for k in other) + "</p>")
    out.append("</div>")
    if fs:
        out.append("<div>" + _per_request(m) + "</div>")
    out.append("</div></section>")
    return "\n".join(out)


def _covered_kinds(table: str) -> set[str]:
    return set(re.findall(r"<tr class=\"\w+\"><td>([^<]+)</td>", table))


def _per_request(m: Model) -> str:
    by_req: dict[str, list[int]] = collections.defaultdict(list)
    for i, f in enumerate(m.findings):
        by_req[f.req or "(no request)"].append(i)
    rows = []
    ordered = sorted(by_req.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    for req, idx in ordered[:MAX_REQUEST_ROWS]:
        fs = [m.findings[i] for i in idx]
        kinds = sorted({f.kind for f in fs})
        steps = [f.step for f in fs if f.step is not None]
        pair = m.d2p.get(req) or m.p2d.get(req)
        name = esc(req) + (f' <span class="note">(pair {esc(pair)})</span>' if pair else "")
        evl = (f'<a class="filtreq" href="#events" data-req="{esc(req)}">its events ↓</a>'
               if req != "(no request)" else "")
        rows.append(f'<tr><td>{name}</td><td>{finding_link(idx[0], f"<b>{len(idx)}</b>")}'
                    f"</td><td>{esc(', '.join(kinds))}</td><td>{esc(_ranges(steps))}</td>"
                    f"<td>{evl}</td></tr>")
    more = (f'<p class="note">{len(ordered) - MAX_REQUEST_ROWS} more request(s) with findings: see the findings table.</p>'
            if len(ordered) > MAX_REQUEST_ROWS else "")
    return ('<h3>Findings per request</h3><table class="coverage"><tr><th>request</th><th>findings</th>'
            "<th>bug classes</th><th>steps</th><th>event table</th></tr>" + "".join(rows) + "</table>" + more)


def trace_html(header: dict, footer: dict | None, problems: Sequence[Any], events: list[dict],
               totals: Any = None) -> str:
    """``totals``: the counts of a trace read in two passes (``events`` are those kept)."""
    if totals is not None:
        counts = (footer or {}).get("counts") or dict(totals.kinds)
        insts = sorted(totals.insts, key=str)
        n = totals.n
    else:
        counts = (footer or {}).get("counts") or collections.Counter(e["ev"] for e in events)
        insts = sorted({e.get("inst", "-") for e in events})
        n = len(events)
    v = header.get("versions") or {}
    rows = [("origin", header.get("origin")), ("created", header.get("created")), ("host", header.get("host")),
            ("redacted", header.get("redacted")), ("command", " ".join(map(str, header.get("cmd") or []))),
            ("versions", ", ".join(f"{k} {val or '—'}" for k, val in v.items())),
            ("instances", ", ".join(map(str, insts))), ("events", f"{n:,}"),
            ("complete", "yes" if footer is not None and not problems else "NO (damaged or cut trace: read with --lenient)")]
    if footer:
        rows.append(("dropped events", footer.get("dropped", 0)))
        he = footer.get("hook_errors") or {}
        rows.append(("hook errors", ", ".join(f"{k}: {n}" for k, n in he.items()) or "none"))
        sk = (footer.get("hooks") or {}).get("skipped") or {}
        if sk:
            rows.append(("hooks skipped", "; ".join(f"{k}: {r}" for k, r in sk.items())))
    out = ['<section id="summary"><details><summary><h2 class="inline">Trace</h2> '
           f'<span class="note">{esc(header.get("origin"))}, {n:,} events, instances {esc(", ".join(map(str, insts)))}'
           + ("" if footer is not None and not problems else ", <b class='warn'>damaged or cut</b>")
           + '</span></summary><table class="kv">']
    out += [f"<tr><th>{esc(k)}</th><td>{esc(val)}</td></tr>" for k, val in rows]
    out.append("</table>")
    if problems:
        out.append(f'<p class="warn">{len(problems)} problem line(s) skipped: '
                   + esc("; ".join(str(p) for p in list(problems)[:5])) + "</p>")
    out.append('<details><summary>events per kind</summary><table class="counts">'
               + "".join(f"<tr><td>{esc(k)}</td><td>{n:,}</td></tr>" for k, n in sorted(counts.items()))
               + "</table></details></details></section>")
    return "\n".join(out)


# only what names a trace event: a bare '#N' in a finding is a block position ('local #0'), a row or a vLLM issue
# ('#44151'), and was linked to event N (a new user's pass on a live trace's report, 2026-11-27)
_TRACE_EVENT = re.compile(r"(trace events? |event #)(\d+)\b")


def _linkify(text: str, linkable: Callable[[int], bool]) -> str:
    """Escaped text with 'trace event 107' / '#107' turned into links to the event table."""
    out, pos = [], 0
    for mo in _TRACE_EVENT.finditer(text):
        i = int(mo.group(2))
        if not linkable(i):
            continue
        out.append(esc(text[pos:mo.start(2)]))
        out.append(f'<a class="evlink" href="#ev-{i}" data-ev="{i}">{i}</a>')
        pos = mo.end(2)
    out.append(esc(text[pos:]))
    return "".join(out)


def findings_html(m: Model, ranges: list[tuple[float, float] | None], linkable: Callable[[int], bool]) -> str:
    fs: list[FindingView] = m.findings[:MAX_FINDING_ROWS]
    out = ['<section id="findings"><h2>Findings</h2>']
    if not fs:
        out.append('<p class="note">None (see the summary for what was checked).</p></section>')
        return "\n".join(out)
    if len(m.findings) > len(fs):
        out.append(f'<p class="warn">The first {len(fs):,} of {len(m.findings):,} findings are listed (the summary counts '
                   "all of them); <code>pdtrace check --format json</code> lists every one.</p>")
    out.append('<p class="note">Click a row to zoom every time axis to the finding and list the events it cites; '
               '<kbd>n</kbd> / <kbd>p</kbd> step through the findings. A cited event id opens that event in the '
               "event table.</p>")
    out.append('<div class="findwrap"><table class="findings"><thead><tr><th>#</th><th>severity</th><th>kind</th>'
               "<th>instance</th><th>step</th><th>request</th><th>finding</th><th>time (ms)</th><th>events</th></tr>"
               "</thead><tbody>")
    for k, f in enumerate(fs):
        shown = f.event_ids[:MAX_LINKED_IDS]
        ids = ", ".join(ev_link(i) for i in shown)
        if len(f.event_ids) > len(shown):
            ids += f' <span class="note">+{len(f.event_ids) - len(shown)} more (select the finding)</span>'
        r = ranges[k]
        when = f"{r[0]:.3f}–{r[1]:.3f}" if r else "—"
        out.append(
            f'<tr id="finding-{k + 1}" class="finding {esc(f.severity)}" data-finding="{k}" tabindex="0">'
            f"<td>{k + 1}</td><td><span class=\"sev {esc(f.severity)}\">{esc(f.severity)}</span></td>"
            f"<td>{esc(f.kind)}</td><td>{esc(f.inst or '')}</td><td>{esc('' if f.step is None else f.step)}</td>"
            f"<td>{esc(f.req or '')}</td><td><b>{esc(f.title)}</b><div class='expl'>{_linkify(f.explanation, linkable)}"
            "</div>"
            + (f"<details><summary>data</summary><pre>{esc(short(f.data, 2000))}</pre></details>" if f.data else "")
            + f"</td><td class='when'>{when}</td><td class='fev'>{ids}</td></tr>")
    out.append("</tbody></table></div></section>")
    return "\n".join(out)
