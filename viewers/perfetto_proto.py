"""Perfetto's protobuf trace format (``.pftrace``), written with Perfetto's own Python
builder (``perfetto.trace_builder.proto_builder.StreamingTraceProtoBuilder``, in the
``perfetto`` package: ``pip install 'pdtrace[perfetto]'``).

It carries what the JSON export (``viewers.perfetto``) carries -- the same lanes, slices,
KV-transfer flows, instants and findings, built by ``viewers.perfetto.build`` -- as
TrackEvent packets, which Perfetto reads faster and stores smaller than trace-event JSON:

- one process track per lane (instance + role), a named child track per thread lane
  (rank or pid) and category; slices (``X``, and ``b``/``e`` pairs) that overlap on one
  such track go to numbered sibling tracks (``kv #2``), so every track's slices are
  disjoint (no misnested begin/end pairs);
- a flow (``s``/``f``) becomes ``flow_ids`` on an instant where it starts and
  ``terminating_flow_ids`` where it ends;
- event fields become debug annotations (ints and bools typed, JSON text for lists and
  dicts);
- event names, categories and annotation names are interned (``interned_data``), so a
  name repeated across packets is stored once.

All packets are on one trusted sequence whose first packet clears the incremental state.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Iterable

import orjson

from pdtrace.errors import PdtraceError

_SEQ = 1


def _uuid(*parts: Any) -> int:
    """A stable 63-bit id for a track or flow (a hash of its parts)."""
    b = orjson.dumps(parts)
    return (zlib.crc32(b) << 31 ^ zlib.adler32(b)) & ((1 << 63) - 1) or 1


class _Writer:
    def __init__(self, fh: Any, pb: Any, builder_cls: Any):
        self.b = builder_cls(fh)
        self.pb = pb
        self.first = True
        self.tracks: dict[Any, int] = {}
        self.lanes: dict[tuple, list[float]] = {}  # (p, t, cat) -> end time of each sibling track
        self.packets = 0
        self.interned: dict[str, dict[str, int]] = {}

    def packet(self, interned: bool = False) -> Any:
        p = self.b.create_packet()
        p.trusted_packet_sequence_id = _SEQ
        if self.first:
            p.sequence_flags = self.pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            p.first_packet_on_sequence = True
            self.first = False
        elif interned:
            p.sequence_flags = self.pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        return p

    def iid(self, p: Any, table: str, value: str) -> int:
        """The interned id of ``value`` in ``table`` (event_names, event_categories,
        debug_annotation_names), adding it to this packet's interned_data when new."""
        ids = self.interned.setdefault(table, {})
        i = ids.get(value)
        if i is None:
            i = ids[value] = len(ids) + 1
            entry = getattr(p.interned_data, table).add()
            entry.iid = i
            entry.name = value
        return i

    def emit(self, p: Any) -> None:
        self.b.write_packet(p)
        self.packets += 1

    def track(self, key: Any, name: str, parent: int | None = None, pid: int | None = None) -> int:
        u = self.tracks.get(key)
        if u is not None:
            return u
        u = self.tracks[key] = _uuid("track", key)
        p = self.packet()
        td = p.track_descriptor
        td.uuid = u
        if pid is not None:
            td.process.pid = pid
            td.process.process_name = name
        else:
            td.name = name
        if parent is not None:
            td.parent_uuid = parent
        self.emit(p)
        return u

    def event(self, track: int, ts_us: float, kind: int, name: str = "", cat: str = "",
              args: dict | None = None, flows: Iterable[int] = (), ends: Iterable[int] = ()) -> None:
        p = self.packet(interned=True)
        p.timestamp = int(round(ts_us * 1000))
        te = p.track_event
        te.type = kind
        te.track_uuid = track
        if name:
            te.name_iid = self.iid(p, "event_names", name)
        if cat:
            te.category_iids.append(self.iid(p, "event_categories", cat))
        for f in flows:
            te.flow_ids.append(f)
        for f in ends:
            te.terminating_flow_ids.append(f)
        for k, v in (args or {}).items():
            d = te.debug_annotations.add()
            d.name_iid = self.iid(p, "debug_annotation_names", str(k))
            if isinstance(v, bool):
                d.bool_value = v
            elif isinstance(v, int) and -(1 << 63) <= v < (1 << 63):
                d.int_value = v
            else:
                d.string_value = v if isinstance(v, str) else orjson.dumps(v, default=str).decode()
        self.emit(p)


def write(trace: Any, path: str | os.PathLike, findings: Iterable[Any] = ()) -> dict[str, Any]:
    """Write ``trace`` (with ``findings``) as a Perfetto protobuf trace; returns counts."""
    try:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder
    except ImportError:
        raise PdtraceError("the Perfetto protobuf export needs the perfetto package (with its trace builder): "
                           "pip install 'pdtrace[perfetto]' (or pip install 'perfetto>=0.50')") from None
    from .perfetto import build

    obj = build(trace.events, findings, trace.header)
    te_list = obj["traceEvents"]
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in te_list:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    # slices: X as they are, b/e paired by (cat, id, name); sorted by start for lane packing
    slices: list[tuple[float, float, dict]] = []
    opened: dict[tuple, dict] = {}
    for e in te_list:
        ph = e["ph"]
        if ph == "X":
            slices.append((e["ts"], e["ts"] + max(e.get("dur", 0.0), 0.0), e))
        elif ph == "b":
            opened[(e.get("cat"), e.get("id"), e.get("pid"))] = e
        elif ph == "e":
            b = opened.pop((e.get("cat"), e.get("id"), e.get("pid")), None)
            if b is not None:
                slices.append((b["ts"], max(e["ts"], b["ts"]), b))
    slices.sort(key=lambda s: (s[0], -s[1]))
    tmp = f"{path}.tmp"
    BEGIN, END, INSTANT = pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END, pb.TrackEvent.TYPE_INSTANT
    n_flows = n_inst = 0
    with open(tmp, "wb") as fh:
        w = _Writer(fh, pb, StreamingTraceProtoBuilder)

        def proc_track(p: int) -> int:
            return w.track(("p", p), procs.get(p, f"lane {p}"), pid=p)

        def lane(p: int, t: int, cat: str, start: float, end: float) -> int:
            ends = w.lanes.setdefault((p, t, cat), [])
            k = next((i for i, x in enumerate(ends) if x <= start), None)
            if k is None:
                ends.append(end)
                k = len(ends) - 1
            else:
                ends[k] = end
            name = f"{threads.get((p, t), f'tid {t}')} · {cat or 'events'}" + (f" #{k + 1}" if k else "")
            return w.track(("t", p, t, cat, k), name, parent=proc_track(p))

        for start, end, e in slices:
            tr = lane(e["pid"], e["tid"], e.get("cat", ""), start, end)
            w.event(tr, start, BEGIN, e["name"], e.get("cat", ""), e.get("args"))
            w.event(tr, end, END)
        glob = None
        for e in te_list:
            ph = e["ph"]
            if ph == "i":
                if e.get("s") == "g":
                    if glob is None:
                        glob = w.track(("global",), "pdtrace findings")
                    tr = glob
                else:
                    tr = w.track(("t", e["pid"], e["tid"], "instants"),
                                 f"{threads.get((e['pid'], e['tid']), 'tid ' + str(e['tid']))} · instants",
                                 parent=proc_track(e["pid"]))
                w.event(tr, e["ts"], INSTANT, e["name"], e.get("cat", ""), e.get("args"))
                n_inst += 1
            elif ph in ("s", "f"):
                fid = _uuid("flow", e.get("cat"), e.get("id"))
                tr = w.track(("t", e["pid"], e["tid"], "flows"),
                             f"{threads.get((e['pid'], e['tid']), 'tid ' + str(e['tid']))} · flows",
                             parent=proc_track(e["pid"]))
                if ph == "s":
                    w.event(tr, e["ts"], INSTANT, e["name"], e.get("cat", ""), flows=[fid])
                    n_flows += 1
                else:
                    w.event(tr, e["ts"], INSTANT, e["name"], e.get("cat", ""), ends=[fid])
    os.replace(tmp, path)
    return {"packets": w.packets, "slices": len(slices), "instants": n_inst, "flows": n_flows,
            "tracks": len(w.tracks), "bytes": os.path.getsize(path), "findings": obj["otherData"]["findings"]}
