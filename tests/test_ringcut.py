"""Findings on what the flight-recorder window cut (pdtrace/detectors/ringcut.py): on a ring
trace (header ring_s), a finding whose request began before the window, whose D2H copy was
issued before it, or whose step's kvmeta.bind is before it, is inconclusive (check exits 4,
not 1); the same events in a trace that is not a ring trace, or a ring trace that kept every
beginning, keep their verdicts. Built from the bundled samples (real vLLM scheduler / NIXL
code and the documented worker simulation) by dropping what a window would have discarded."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from pdtrace.commands.check import exit_code
from pdtrace.detectors import run_all
from pdtrace.detectors.base import SEVERITY_INCONCLUSIVE
from pdtrace.detectors.coverage import coverage
from pdtrace.tracefile.trace import load

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def _sample(name: str):
    tr = load(str(SAMPLES / f"{name}.jsonl"))
    return [dict(e) for e in tr.events], dict(tr.header)


def _ring(header: dict) -> dict:
    return {**header, "ring_s": 30.0}


def _renumber(events):
    out = copy.deepcopy(events)
    return out


@pytest.mark.parametrize("name", ["lookahead_aligned16_k1_buggy", "stale_read_rowmoves_buggy",
                                  "metadata_cleared_before_drafter_buggy", "dflash_window_buggy"])
def test_a_ring_trace_that_kept_every_beginning_keeps_its_verdicts(name):
    events, header = _sample(name)
    plain = run_all(events, header)
    ring = run_all(events, _ring(header))
    assert plain and [(f.kind, f.severity, f.title) for f in ring] == [(f.kind, f.severity, f.title) for f in plain]


def test_a_request_that_began_before_the_window_is_inconclusive():
    events, header = _sample("lookahead_aligned16_k1_buggy")
    (f,) = [f for f in run_all(events, header) if f.kind == "lookahead-block-misalignment"]
    p_req = f.data.get("p_req") or f.req
    cut = [e for e in events if not (e["ev"] == "req.add" and e.get("req") == p_req)]
    assert len(cut) == len(events) - 1
    (g,) = [x for x in run_all(cut, _ring(header)) if x.kind == f.kind]
    assert g.severity == SEVERITY_INCONCLUSIVE and g.data["severity_in_window"] == f.severity
    assert "began on" in g.data["ring_cut"] and g.title.startswith("(cut by the flight-recorder window)")
    assert exit_code([g], coverage(cut, _ring(header))) == 4
    # the same events, not a ring trace: a verdict as before
    (h,) = [x for x in run_all(cut, header) if x.kind == f.kind]
    assert h.severity == f.severity


def test_a_read_of_a_copy_issued_before_the_window_is_inconclusive():
    events, header = _sample("stale_read_rowmoves_buggy")
    found = run_all(events, header)
    first = min(f.data["d2h_event"] for f in found)
    cut = [e for e in events if not (e["ev"] == "d2h.issue" and e.get("event") == first)]
    after = run_all(cut, _ring(header))
    on_first = [f for f in after if f.data.get("d2h_event") == first]
    assert on_first and all(f.severity == SEVERITY_INCONCLUSIVE and "issued before" in f.data["ring_cut"]
                            for f in on_first)
    others = [f for f in after if f.data.get("d2h_event") != first]
    assert others and all(f.severity != SEVERITY_INCONCLUSIVE for f in others)


def test_a_step_whose_bind_is_before_the_window_is_inconclusive():
    events, header = _sample("metadata_cleared_before_drafter_buggy")
    (f,) = [f for f in run_all(events, header) if f.kind == "connector-metadata-cleared-before-drafter"][:1]
    bind = next(e for e in events if e["ev"] == "kvmeta.bind" and e["id"] in f.event_ids)
    # the window begins right after that bind on its process
    cut = [e for e in events if not (e["pid"] == bind["pid"] and e["id"] <= bind["id"]
                                     and e["ev"] not in ("sched.config", "proc.start", "hooks.status", "runner"))]
    got = [g for g in run_all(cut, _ring(header)) if g.kind == f.kind and g.step == f.step]
    assert got and got[0].severity == SEVERITY_INCONCLUSIVE and "kvmeta.bind" in got[0].data["ring_cut"]
