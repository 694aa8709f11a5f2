"""`pdtrace export --parquet DIR` and `--perfetto-proto FILE` (issue 22: exports into engines users run).

Parquet: every event of a trace comes back from the per-kind tables (read with pyarrow) equal
to the event in the trace, typed columns for the schema's scalar and list types, JSON text
for the rest; small row groups force the streamed, batched path. Perfetto protobuf: the file
parses with Perfetto's own protos (``perfetto_trace_pb2.Trace``), holds one slice per slice
of the JSON export, disjoint slices per track, every KV flow started and terminated, and the
findings as instants; Perfetto's trace processor loads it where its binary can be fetched.
"""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

from pdtrace import schema  # noqa: E402
from pdtrace.commands import export as export_cmd  # noqa: E402
from pdtrace.detectors import run_all  # noqa: E402
from pdtrace.errors import PdtraceError  # noqa: E402
from pdtrace.tracefile.trace import iter_events, load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _rows_back(out: Path) -> dict[int, dict]:
    """Every exported row as an event dict again: non-null columns, JSON columns decoded, extra merged."""
    back: dict[int, dict] = {}
    for f in sorted(out.glob("*.parquet")):
        kind = f.name[: -len(".parquet")]
        spec = {fl.name: fl.type for fl in list(schema.COMMON) + list(schema.KINDS[kind].fields)}
        for row in pq.read_table(f).to_pylist():
            extra = row.pop("extra")
            e = {}
            for k, v in row.items():
                if v is None:
                    continue
                t = spec[k].replace(" ", "")
                e[k] = json.loads(v) if t not in ("int", "str", "bool", "float", "list[int]", "list[str]",
                                                  "list[list[int]]") else v
            if extra:
                e.update(json.loads(extra))
            back[e["id"]] = e
    return back


@pytest.mark.parametrize("name", ["stale_read_rowmoves_buggy.jsonl", "live_cpu_pd_eagle.jsonl",
                                  "live_gpu_pd_eagle_v2.jsonl.zst"])
def test_parquet_round_trips_every_event(tmp_path, name):
    from pdtrace.viewers import parquet

    trace = SAMPLES / name
    out = tmp_path / "pq"
    st = parquet.write(str(trace), out, batch=7)  # many row groups: the batched path
    events = list(iter_events(str(trace)))  # as the file has them (load would derive v2 block lists)
    assert st["events"] == len(events) and st["problems"] == 0
    back = _rows_back(out)
    assert len(back) == len(events)
    for e in events:
        assert back[e["id"]] == {k: v for k, v in e.items() if v is not None}, (e["id"], e["ev"])
    meta = json.loads((out / "_trace.json").read_text())
    assert meta["header"]["schema"] == "pdtrace" and sum(meta["rows"].values()) == len(events)
    # typed columns, not text
    t = pq.read_table(out / "acc.read.parquet" if (out / "acc.read.parquet").exists() else out / "sched.alloc.parquet")
    assert pa.types.is_integer(t.schema.field("t").type) and pa.types.is_integer(t.schema.field("pid").type)


def test_parquet_export_memory_does_not_hold_the_trace(tmp_path):
    """A 40k-event generated trace (~10 MB): the export's Python allocations peak well under
    what loading the events would take (~1.5 KiB per event)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gen_trace

    from pdtrace.viewers import parquet

    path = tmp_path / "big.jsonl"
    gen_trace.generate(str(path), 40_000)
    tracemalloc.start()
    try:
        st = parquet.write(str(path), tmp_path / "out", batch=2048)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert st["events"] >= 40_000
    assert peak < 20 << 20, f"export peaked at {peak >> 20} MiB of Python allocations"


def test_missing_extras_are_named_together(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("perfetto", "pyarrow") else real(n, *a))
    with pytest.raises(PdtraceError, match=r"pip install 'pdtrace\[perfetto,parquet\]'"):
        export_cmd.run(SAMPLES / "dflash_window_buggy.jsonl", perfetto_proto=tmp_path / "x.pftrace",
                       parquet=tmp_path / "pq")
    assert not (tmp_path / "x.pftrace").exists() and not (tmp_path / "pq").exists()


def test_export_cli_needs_a_target_and_parquet_writes_tables(tmp_path):
    trace = SAMPLES / "dflash_window_buggy.jsonl"
    with pytest.raises(PdtraceError, match="nothing to export"):
        export_cmd.run(trace)
    assert export_cmd.run(trace, parquet=tmp_path / "pq") == 0
    assert (tmp_path / "pq" / "spec.window.parquet").exists()


# ------------------------------------------------------------------------------ Perfetto protobuf
@pytest.fixture(scope="module")
def proto_export(tmp_path_factory):
    pytest.importorskip("perfetto.trace_builder.proto_builder")
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    d = tmp_path_factory.mktemp("pp")
    trace = bc.write_buggy_trace(d / "buggy.jsonl")
    assert export_cmd.run(Path(trace), perfetto=d / "out.json", perfetto_proto=d / "out.pftrace") == 0
    msg = pb.Trace.FromString((d / "out.pftrace").read_bytes())
    return Path(trace), d, json.loads((d / "out.json").read_text()), msg, pb


def test_perfetto_proto_has_the_json_exports_slices_flows_and_findings(proto_export):
    trace, d, js, msg, pb = proto_export
    te = js["traceEvents"]
    n_slices = sum(1 for e in te if e["ph"] in ("X", "b"))
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in msg.packet if p.HasField("track_descriptor")}
    events = [p for p in msg.packet if p.HasField("track_event")]
    begins = [p for p in events if p.track_event.type == pb.TrackEvent.TYPE_SLICE_BEGIN]
    ends = [p for p in events if p.track_event.type == pb.TrackEvent.TYPE_SLICE_END]
    assert len(begins) == len(ends) == n_slices > 0
    assert all(p.track_event.track_uuid in tracks for p in events)
    assert all(p.trusted_packet_sequence_id == 1 for p in msg.packet)
    assert msg.packet[0].sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    # per track, begin/end alternate in time: slices disjoint, never misnested
    per: dict[int, list] = {}
    for p in events:
        if p.track_event.type in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END):
            per.setdefault(p.track_event.track_uuid, []).append((p.timestamp, p.track_event.type))
    for uuid, seq in per.items():
        depth = 0
        for _ts, typ in seq:  # written in order per track
            depth += 1 if typ == pb.TrackEvent.TYPE_SLICE_BEGIN else -1
            assert depth in (0, 1), tracks[uuid].name
    # flows: each started once and terminated
    starts = [f for p in events for f in p.track_event.flow_ids]
    stops = [f for p in events for f in p.track_event.terminating_flow_ids]
    assert sorted(starts) == sorted(stops) and len(starts) == sum(1 for e in te if e["ph"] == "s") > 0
    # findings: one instant each, category "finding", on the lane of the first event it cites (as in the JSON)
    tr = load(str(trace))
    findings = run_all(tr.events, header=tr.header)
    names = {e.iid: e.name for p in msg.packet for e in p.interned_data.event_names}
    cats = {e.iid: e.name for p in msg.packet for e in p.interned_data.event_categories}
    assert sorted(names) == list(range(1, len(names) + 1))  # each interned once
    fi = [p for p in events if "finding" in [cats[c] for c in p.track_event.category_iids]]
    assert len(fi) == len(findings) > 0 and all(p.track_event.type == pb.TrackEvent.TYPE_INSTANT for p in fi)
    assert sorted(names[p.track_event.name_iid] for p in fi) == sorted(f"FINDING: {f.title}" for f in findings)
    keys = {e.iid: e.name for p in msg.packet for e in p.interned_data.debug_annotation_names}
    steps = [d for p in events for d in p.track_event.debug_annotations if keys[d.name_iid] == "step"]
    assert steps and all(d.HasField("int_value") for d in steps)  # typed, not text
    lanes = {t.process.process_name for t in tracks.values() if t.HasField("process")}
    assert any(n.startswith("P ") for n in lanes) and any(n.startswith("D ") for n in lanes)


def test_perfetto_trace_processor_loads_the_proto(proto_export):
    tp_mod = pytest.importorskip("perfetto.trace_processor",
                                 reason="perfetto Python package not installed (pip install perfetto)")
    _trace, d, js, _msg, _pb = proto_export
    try:
        tp = tp_mod.TraceProcessor(trace=str(d / "out.pftrace"))
    except Exception as exc:  # the package downloads trace_processor_shell on first use
        pytest.skip(f"perfetto trace processor unavailable offline: {type(exc).__name__}: {exc}")
    try:
        n = next(iter(tp.query("select count(*) as c from slice where dur >= 0 and category != 'finding'"))).c
        assert n >= sum(1 for e in js["traceEvents"] if e["ph"] in ("X", "b"))
    finally:
        tp.close()
