"""The report's root causes, first on the page and in the words `pdtrace check` uses
(``pdtrace.detectors.causes``): each cause's title, counts, where in vLLM (links to the source at
the recorded release's tag), the upstream issues, and its first finding (a link that selects it)."""

from __future__ import annotations

from typing import Any, Callable

from pdtrace.detectors.causes import group, header_vllm, source_link, trace_locations

from .common import esc


def causes_html(findings: list[Any], events: list[dict], header: dict,
                finding_link: Callable[[int, str], str]) -> str:
    if not findings:
        return ""
    vllm = header_vllm(header)
    where = trace_locations(events, header)
    causes = group(findings, where)
    out = [f'<div class="causes"><p><b>{len(causes)} root cause{"s" if len(causes) != 1 else ""}</b> '
           f'(as <code>pdtrace check</code> names them; <code>--cause N</code> lists one):</p><ol>']
    for c in causes:
        cls = "bad" if c.severity == "error" else "warn"
        parts = [f'<li><span class="{cls}"><b>{esc(c.severity.upper())}</b> {esc(c.kind)}</span>: '
                 f"<b>{esc(c.title)}</b><br>{esc(c.counts_text())}"]
        if c.where:
            parts.append(f"<br>{esc(c.where_words)} " + esc(vllm) + ": " + ", ".join(
                f'<a href="{esc(source_link(w, vllm))}"><code>{esc(w["file"])}:{w["line"]}</code></a> '
                f'({esc(w["function"])})' for w in c.where))
        if c.upstream:
            parts.append("<br>upstream: " + ", ".join(
                f'<a href="{esc(u)}">#{esc(u.rsplit("/", 1)[-1])}</a>' for u in c.upstream))
        k = c.first["index"]
        parts.append("<br>first: " + finding_link(k, f"finding {k + 1}")
                     + (f" (request {esc(c.first['req'])}" if c.first.get("req") else " (")
                     + (f", step {c.first['step']})" if c.first.get("step") is not None else ")") + "</li>")
        out.append("".join(parts))
    out.append("</ol></div>")
    return "\n".join(out)
