"""Export a trace as Chrome / Perfetto trace-event JSON (``pdtrace export --perfetto``).

Mapping:
- one process per instance/role ("P engine-core", "D worker", ...), sorted P first;
- one thread per TP rank inside it (processes without a rank: one thread per OS pid), plus
  a "connector metadata" track per rank for the bind -> clear span (it overlaps the model
  phases, so it cannot nest in the rank's own track);
- complete slices ("X") for engine steps, target / drafter forwards and metadata spans;
  async slices ("b"/"e", category ``kv``) for NIXL reads (they overlap);
- flow events ("s" -> "f") from P's request_finished to D's NIXL read of the same request;
- instant events ("i") for every other event and for each finding (category ``finding``).

Timestamps are microseconds since the first event of the trace (wall clock ``w``, which
``pdtrace merge`` aligns across hosts); ``otherData.t0_wall_ns`` gives the origin.
No vLLM / torch import here.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Iterable

import orjson

_SPAN_KINDS = {"sched.step", "spec.phase"}
_SKIP_INSTANT = {"spec.phase"}


def _lane_order(inst: str) -> int:
    return {"P": 0, "PD": 1, "D": 2}.get(inst, 3)


class _Ids:
    """Perfetto pids / tids for instance/role processes and rank threads."""

    def __init__(self) -> None:
        self.procs: dict[tuple[str, str], int] = {}
        self.threads: dict[tuple[int, int], str] = {}
        self.meta: list[dict[str, Any]] = []

    def pid(self, e: dict[str, Any]) -> int:
        key = (str(e.get("inst", "-")), str(e.get("role", "?")))
        p = self.procs.get(key)
        if p is None:
            p = self.procs[key] = len(self.procs) + 1
            self.meta.append({"ph": "M", "name": "process_name", "pid": p, "tid": 0,
                              "args": {"name": f"{key[0]} {key[1]}"}})
            self.meta.append({"ph": "M", "name": "process_sort_index", "pid": p, "tid": 0,
                              "args": {"sort_index": _lane_order(key[0]) * 10 + p}})
        return p

    def tid(self, e: dict[str, Any], track: str = "") -> tuple[int, int]:
        p = self.pid(e)
        if "rank" in e:
            t, name = int(e["rank"]), f"rank {e['rank']}"
        else:
            t, name = int(e.get("pid", 0)), f"pid {e.get('pid')}"
        if track:
            t, name = t + 1_000_000, f"{name}: {track}"
        if (p, t) not in self.threads:
            self.threads[(p, t)] = name
            self.meta.append({"ph": "M", "name": "thread_name", "pid": p, "tid": t, "args": {"name": name}})
            self.meta.append({"ph": "M", "name": "thread_sort_index", "pid": p, "tid": t, "args": {"sort_index": t}})
        return p, t


def _args(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("ev", "t", "w")}


def build(events: list[dict[str, Any]], findings: Iterable[Any] = (), header: dict | None = None) -> dict[str, Any]:
    """The trace-event JSON object for ``events`` (and findings as instant events)."""
    key = "w" if events and all("w" in e for e in events[:1000]) else "t"
    t0 = min((e[key] for e in events), default=0)

    def ts(e: dict[str, Any]) -> float:
        return (e[key] - t0) / 1000.0

    ids = _Ids()
    out: list[dict[str, Any]] = []
    by_id = {e.get("id", i): e for i, e in enumerate(events)}

    # engine steps: from one sched.step to the next on the same process
    steps: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e["ev"] == "sched.step":
            steps[e["pid"]].append(e)
    for ss in steps.values():
        ss.sort(key=lambda e: e[key])
        for i, e in enumerate(ss):
            p, t = ids.tid(e)
            end = ts(ss[i + 1]) if i + 1 < len(ss) else ts(e) + 1.0
            out.append({"ph": "X", "name": f"step {e.get('step', '?')}", "cat": "sched", "pid": p, "tid": t,
                        "ts": ts(e), "dur": max(end - ts(e), 0.001), "args": _args(e)})

    open_phase: dict[tuple[int, str], dict] = {}
    bound: dict[int, dict] = {}
    reads: dict[str, dict] = {}
    p_finished: dict[str, dict] = {}
    flow_id = 0
    d2p: dict[str, str] = {}
    for e in events:
        k = e["ev"]
        if k == "req.add" and isinstance(e.get("kv"), dict) and e["kv"].get("remote_request_id") and "req" in e:
            d2p[e["req"]] = str(e["kv"]["remote_request_id"])

    for e in events:
        k = e["ev"]
        if k == "spec.phase":
            lk = (e["pid"], e["phase"])
            if e["edge"] == "begin":
                open_phase[lk] = e
            elif lk in open_phase:
                b = open_phase.pop(lk)
                p, t = ids.tid(b)
                out.append({"ph": "X", "name": f"{b['phase']} forward", "cat": "spec", "pid": p, "tid": t,
                            "ts": ts(b), "dur": max(ts(e) - ts(b), 0.001), "args": _args(b)})
            continue
        if k == "kvmeta.bind":
            bound[e["pid"]] = e
        elif k == "kvmeta.clear" and e["pid"] in bound:
            b = bound.pop(e["pid"])
            p, t = ids.tid(b, "connector metadata")
            out.append({"ph": "X", "name": "connector metadata bound", "cat": "kvmeta", "pid": p, "tid": t,
                        "ts": ts(b), "dur": max(ts(e) - ts(b), 0.001), "args": _args(b)})
        if k == "nixl.request_finished" and e.get("side") == "P" and "req" in e:
            p, t = ids.tid(e)
            out.append({"ph": "X", "name": f"request_finished {e['req']}", "cat": "kv", "pid": p, "tid": t,
                        "ts": ts(e), "dur": 1.0, "args": _args(e)})
            p_finished[str(e["req"])] = e
            continue
        if k == "nixl.read":
            p, t = ids.tid(e)
            handle = str(e.get("handle") or f"read-{e.get('id')}")
            reads[handle] = e
            if "req" in e:
                reads.setdefault(f"req:{e['req']}", e)
            name = f"KV read {e.get('req', '')}".strip()
            out.append({"ph": "X", "name": f"issue {name}", "cat": "kv", "pid": p, "tid": t, "ts": ts(e), "dur": 1.0,
                        "args": _args(e)})
            out.append({"ph": "b", "name": name, "cat": "kv", "id": handle, "pid": p, "tid": t, "ts": ts(e),
                        "args": _args(e)})
            preq = str(e.get("remote_req") or d2p.get(e.get("req", ""), e.get("req", "")))
            src = p_finished.get(preq)
            if src is not None:
                flow_id += 1
                sp, st = ids.tid(src)
                out.append({"ph": "s", "name": "KV transfer", "cat": "kv", "id": flow_id, "pid": sp, "tid": st,
                            "ts": ts(src)})
                out.append({"ph": "f", "bp": "e", "name": "KV transfer", "cat": "kv", "id": flow_id, "pid": p,
                            "tid": t, "ts": ts(e)})
            continue
        if k == "nixl.read_done":
            r = reads.pop(str(e.get("handle")), None) if e.get("handle") is not None else None
            if r is None and "req" in e:
                r = reads.pop(f"req:{e['req']}", None)
            if r is not None:
                p, t = ids.tid(r)
                handle = str(r.get("handle") or f"read-{r.get('id')}")
                out.append({"ph": "e", "name": f"KV read {r.get('req', '')}".strip(), "cat": "kv", "id": handle,
                            "pid": p, "tid": t, "ts": max(ts(e), ts(r)), "args": {"status": e.get("status")}})
        if k in _SKIP_INSTANT or k == "sched.step":
            continue
        p, t = ids.tid(e)
        name = k if "req" not in e else f"{k} {e['req']}"
        out.append({"ph": "i", "s": "t", "name": name, "cat": k.split(".", 1)[0], "pid": p, "tid": t,
                    "ts": ts(e), "args": _args(e)})

    n_findings = 0
    for f in findings:
        d = f.to_dict() if hasattr(f, "to_dict") else dict(f)
        cited = [by_id[i] for i in d.get("event_ids") or [] if i in by_id]
        args = {k: d.get(k) for k in ("kind", "severity", "req", "step", "inst", "event_ids", "explanation")}
        if cited:
            e = cited[0]
            p, t = ids.tid(e)
            out.append({"ph": "i", "s": "t", "name": f"FINDING: {d.get('title')}", "cat": "finding", "pid": p,
                        "tid": t, "ts": ts(e), "args": args})
        else:
            out.append({"ph": "i", "s": "g", "name": f"FINDING: {d.get('title')}", "cat": "finding", "pid": 0,
                        "tid": 0, "ts": 0.0, "args": args})
        n_findings += 1

    other = {"source": "pdtrace", "clock": key, "t0_wall_ns" if key == "w" else "t0_monotonic_ns": t0,
             "findings": n_findings}
    if header:
        other.update({"origin": header.get("origin"), "versions": header.get("versions"),
                      "schema_version": header.get("schema_version")})
    return {"traceEvents": ids.meta + out, "displayTimeUnit": "ms", "otherData": other}


def write(trace: Any, path: str | os.PathLike, findings: Iterable[Any] = ()) -> dict[str, Any]:
    obj = build(trace.events, findings, trace.header)
    data = orjson.dumps(obj)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
    te = obj["traceEvents"]
    return {"events": len(te), "flows": sum(1 for e in te if e["ph"] == "s"), "bytes": len(data),
            "findings": obj["otherData"]["findings"],
            "processes": sum(1 for e in te if e["ph"] == "M" and e["name"] == "process_name")}
