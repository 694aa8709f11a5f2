"""One check of a trace file, shared by `pdtrace check` and the viewer's background check
(``detectors.background``): line 1 read once (``tracefile.trace.read_header``) and handed on
to every pass; the detectors streamed segment by segment (in one process, or split over
``jobs`` by ``detectors.parallel``), or, for a flight-recorder trace (bounded by its window;
the ring-cut rules look back over all of it), the trace loaded whole. No vLLM, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..tracefile.damage import incomplete_reason
from ..tracefile.trace import ProgressFn, load, read_header
from ..tracefile.zsource import is_gap
from . import DETECTORS, Finding, parallel, run_with_notes, stream, whatif
from .causes import header_vllm, locations, trace_locations
from .index import build, feed_all
from .coverage import Coverage, IndexFacts, coverage_of
from .ringcut import mark_after_gap


@dataclasses.dataclass
class Checked:
    """What one check found. ``trace``: the stream's ``Result`` or the loaded ``Trace`` (both
    have ``path``, ``header``, ``footer``, ``problems``, ``complete``); ``replay``: the
    ``--what-if`` rule's result (None without one); ``request_seen`` / ``requests``: whether
    the request asked about appears, and the requests that do (``req.add``); ``pair``: the
    other side of its P/D pair, whose findings are listed with its own (JSON ``request_other_side``)."""

    trace: Any
    findings: list[Finding]
    coverage: dict[str, Coverage]
    replay: list | None = None
    request_seen: bool = True
    requests: list[str] = dataclasses.field(default_factory=list)
    notes: dict[str, list] = dataclasses.field(default_factory=dict)  # detector -> facts (``Stream.notes``)
    pair: list[str] = dataclasses.field(default_factory=list)
    where: dict[str, dict] = dataclasses.field(default_factory=dict)  # hook -> vLLM source (``causes.locations``)


def check_file(path: str, *, only: list[str] | tuple = (), request: str | None = None, lenient: bool = False,
               progress: ProgressFn | None = None, jobs: int = 1, what_if: str | None = None) -> Checked:
    """The detectors of ``only`` (all when empty) over the trace at ``path``, with each bug
    class's coverage, as `pdtrace check` reports them. ``jobs`` >= 2 splits a streamed check
    over processes (not with ``what_if``: its replay is fed the segments in one pass)."""
    header = read_header(path)
    kinds = list(only) or list(DETECTORS)
    if not header.get("ring_s"):  # memory bounded by the detectors' live state, not the trace
        if jobs >= 2 and not what_if:
            res = parallel.run(path, only=only, request=request, lenient=lenient, progress=progress, jobs=jobs,
                               header=header)
        else:
            res = stream.run(path, only=only, request=request, lenient=lenient, progress=progress, header=header,
                             observe=(lambda: whatif.FixedTrim(request)) if what_if else None)
        seen = res.request
        where = locations(res.summary.kind("hooks.status"), header_vllm(header))
        cov = coverage_of(res.summary, res.footer, kinds=kinds, incomplete=incomplete_reason(res.footer, res.problems),
                          notes=res.notes)
        return Checked(res, after_gap(res.findings, res), cov,
                       replay=res.observed.finish() if what_if else None,
                       request_seen=request is None or seen.seen, requests=list(seen.known),
                       notes=_about_request(res.notes, seen.wanted()), pair=sorted(seen.pair), where=where)
    tr = load(path, lenient=lenient, progress=progress, header=header)
    seen = request is None or any(e.get("req") == request or e.get("remote_req") == request for e in tr.events)
    pair = set() if request is None else stream.pair_of((e for e in tr.events if e["ev"] in stream.PAIR_KINDS), request)
    wanted = None if request is None else {request, *pair}
    found, notes = run_with_notes(tr.events, tr.header, only=only, request=wanted)
    notes = {**_notes(tr.events, tr.header, [k for k in kinds if k not in notes]), **notes}
    return Checked(tr, after_gap(found, tr),
                   coverage_of(IndexFacts(build(tr.events)), tr.footer, kinds=kinds,
                               incomplete=incomplete_reason(tr.footer, tr.problems), notes=notes),
                   replay=whatif.run(what_if, tr.events, request) if what_if else None, request_seen=seen,
                   requests=[] if seen else [e["req"] for e in tr.events if e.get("req") and e["ev"] == "req.add"],
                   notes=_about_request(notes, wanted), pair=sorted(pair),
                   where=trace_locations(tr.events, header))


def after_gap(findings: list[Finding], tr: Any) -> list[Finding]:
    """A .zst read on past damaged frames (``--lenient``): the findings citing an event after the
    first gap are inconclusive (``ringcut.mark_after_gap``, as the viewer does)."""
    last = getattr(tr, "gap_after", None)
    if last is None or not findings:
        return findings
    gap = next(p for p in tr.problems if is_gap(p.reason))
    where = f"the {gap.reason.split()[0]} bytes lost at line {gap.line} (damaged zstd frames)"
    return mark_after_gap(findings, lambda eid: eid > last, where)


def _notes(events: list, header: dict, kinds: list[str]) -> dict[str, list]:
    """The detectors' facts over a loaded trace (``stream.run`` gathers them as it streams)."""
    out = {}
    for kind in kinds:
        cls = stream.STREAMS.get(kind)
        if cls is not None and hasattr(cls, "notes"):
            st = cls(header)
            feed_all(st, events)
            out[kind] = st.notes()
    return out


def _about_request(notes: dict[str, list], wanted: set[str] | None) -> dict[str, list]:
    """The facts about the request asked for and the other side of its pair (all without one)."""
    if not wanted:
        return notes
    return {k: [n for n in v if n.get("req") in wanted] for k, v in notes.items()}
