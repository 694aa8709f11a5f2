"""`pdtrace export --perfetto`: Chrome / Perfetto trace-event JSON.

The output is validated against a JSON schema of the trace-event format written here
from the format's documentation (phases X, i, b/e, s/f, M and their required fields).
Perfetto's own trace processor is tried too; it needs the ``perfetto`` Python package
AND its ``trace_processor_shell`` binary, which that package downloads on first use, so
offline the test is skipped with that reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

from pdtrace.commands import export as export_cmd  # noqa: E402
from pdtrace.tracefile.trace import load  # noqa: E402

_NUM = {"type": "number"}
_ID = {"type": ["integer", "string"]}
_BASE = {"name": {"type": "string"}, "cat": {"type": "string"}, "pid": {"type": "integer"},
         "tid": {"type": "integer"}, "ts": {"type": "number", "minimum": 0}, "args": {"type": "object"}}


def _phase(ph, required, extra=None):
    props = dict(_BASE)
    props["ph"] = {"const": ph}
    props.update(extra or {})
    return {"if": {"properties": {"ph": {"const": ph}}, "required": ["ph"]},
            "then": {"properties": props, "required": ["ph", *required]}}


TRACE_EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
        "traceEvents": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["ph", "pid", "tid", "name"],
                "properties": {"ph": {"enum": ["X", "B", "E", "i", "I", "b", "e", "n", "s", "t", "f", "M", "C"]}},
                "allOf": [
                    _phase("X", ["name", "ts", "dur", "pid", "tid"], {"dur": {"type": "number", "minimum": 0}}),
                    _phase("i", ["name", "ts", "pid", "tid", "s"], {"s": {"enum": ["g", "p", "t"]}}),
                    _phase("b", ["name", "cat", "id", "ts", "pid", "tid"], {"id": _ID}),
                    _phase("e", ["name", "cat", "id", "ts", "pid", "tid"], {"id": _ID}),
                    _phase("s", ["name", "cat", "id", "ts", "pid", "tid"], {"id": _ID}),
                    _phase("f", ["name", "cat", "id", "ts", "pid", "tid"], {"id": _ID, "bp": {"const": "e"}}),
                    _phase("M", ["name", "pid", "args"], {"name": {"enum": [
                        "process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"]}}),
                ],
            },
        },
    },
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("pf")
    trace = bc.write_buggy_trace(d / "buggy.jsonl")
    out = d / "out.json"
    assert export_cmd.run(Path(trace), out, lenient=False) == 0
    return Path(trace), out, json.loads(out.read_text())


def test_schema_is_a_valid_schema():
    jsonschema.Draft202012Validator.check_schema(TRACE_EVENT_SCHEMA)
    # and it rejects what the format forbids
    v = jsonschema.Draft202012Validator(TRACE_EVENT_SCHEMA)
    assert not v.is_valid({"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0}]})  # no dur
    assert not v.is_valid({"traceEvents": [{"ph": "i", "name": "a", "pid": 1, "tid": 1, "ts": 0, "s": "x"}]})


def test_export_validates_against_trace_event_schema(exported):
    _, _, obj = exported
    jsonschema.Draft202012Validator(TRACE_EVENT_SCHEMA).validate(obj)


def test_processes_threads_flows_findings(exported):
    trace, _, obj = exported
    te = obj["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in te if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(procs.values()) == {"P engine-core", "P worker", "D engine-core", "D worker"}
    threads = {(e["pid"], e["args"]["name"]) for e in te if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(procs[p] == "D worker" and n == "rank 0" for p, n in threads)
    # one flow per KV transfer, from a P process to a D process, start before finish
    starts = {e["id"]: e for e in te if e["ph"] == "s"}
    ends = {e["id"]: e for e in te if e["ph"] == "f"}
    tr = load(str(trace))
    n_reads = sum(1 for e in tr.events if e["ev"] == "nixl.read")
    assert len(starts) == len(ends) == n_reads
    for i, s in starts.items():
        f = ends[i]
        assert procs[s["pid"]].startswith("P ") and procs[f["pid"]].startswith("D ")
        assert s["ts"] <= f["ts"]
        # flow ends bind to a slice on the same thread at that time
        assert any(e["ph"] == "X" and e["pid"] == f["pid"] and e["tid"] == f["tid"]
                   and e["ts"] <= f["ts"] <= e["ts"] + e["dur"] for e in te)
    # async read slices are balanced
    b = sorted(e["id"] for e in te if e["ph"] == "b")
    e_ = sorted(e["id"] for e in te if e["ph"] == "e")
    assert b == e_ and len(b) == n_reads
    # one instant per finding from the real detectors
    from pdtrace.detectors import run_all

    findings = run_all(tr.events, header=tr.header)
    fi = [e for e in te if e["ph"] == "i" and e.get("cat") == "finding"]
    assert len(fi) == len(findings) > 0
    assert {e["args"]["kind"] for e in fi} == {f.kind for f in findings}


def test_perfetto_trace_processor_loads_it(exported):
    tp_mod = pytest.importorskip("perfetto.trace_processor",
                                 reason="perfetto Python package not installed (pip install perfetto)")
    _, out, obj = exported
    try:
        tp = tp_mod.TraceProcessor(trace=str(out))
    except Exception as exc:  # the package downloads trace_processor_shell on first use
        pytest.skip(f"perfetto trace processor unavailable offline: {type(exc).__name__}: {exc}")
    try:
        n = next(iter(tp.query("select count(*) as c from slice"))).c
        n_x = sum(1 for e in obj["traceEvents"] if e["ph"] in ("X", "b"))
        assert n >= n_x
    finally:
        tp.close()
