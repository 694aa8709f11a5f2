"""The recorded situation of one request that `pdtrace repro` rebuilds (``situation``): shared by the harness test
(repro.py, --request) and the standalone one (repro_standalone.py, --cause). Reads traces only."""

from __future__ import annotations

from typing import Any

from pdtrace.errors import PdtraceError

# recorded spec method -> harness method with the same lookahead rule
_METHOD_MAP = {"": "", "ngram": "ngram", "eagle": "eagle", "eagle3": "eagle", "mtp": "eagle",
               "draft_model": "eagle", "dflash": "dflash"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _first(events: list[dict], kind: str, **m: Any) -> dict | None:
    for e in events:
        if e["ev"] == kind and all(e.get(k) == v for k, v in m.items()):
            return e
    return None


def situation(events: list[dict], request: str) -> dict[str, Any]:
    """The recorded facts about ``request`` (a P or a D request id) that a repro needs."""
    if not any(e.get("req") == request for e in events):
        known = sorted({e["req"] for e in events if e.get("req") and e["ev"] == "req.add"})[:10]
        raise PdtraceError(f"request {request!r} does not appear in the trace"
                           + (f"; requests seen: {', '.join(known)}" if known else ""))
    ra = _first(events, "nixl.remote_alloc", req=request)
    if ra is not None:  # a D request: its P peer is remote_req
        d_req, p_req = request, ra.get("remote_req")
    else:
        ra = _first(events, "nixl.remote_alloc", remote_req=request)
        p_req, d_req = request, (ra or {}).get("req")
    rf = _first(events, "nixl.request_finished", req=p_req, side="P") if p_req else None
    add = _first(events, "req.add", req=p_req) or _first(events, "req.add", req=request) or {}
    inst = (rf or {}).get("inst") or add.get("inst") or "P"
    conf = _first(events, "sched.config", inst=inst) or _first(events, "sched.config") or {}
    if not conf:
        raise PdtraceError("the trace has no sched.config event (scheduler hooks were not applied): "
                           "cannot tell block size or speculative method")
    p_alloc = _first(events, "sched.alloc", req=p_req) if p_req else None
    trim = _first(events, "nixl.trim", req=d_req) if d_req else None
    faults = [e.get("rule") for e in events if e["ev"] == "fault.inject"]
    block_sizes = list(conf.get("block_sizes") or [16])
    kinds = list(conf.get("group_kinds") or ["FullAttentionSpec"])
    method = conf.get("spec_method") or ""
    k = int(conf.get("num_spec_tokens") or 0)
    prompt_len = int((rf or {}).get("prompt_len") or add.get("prompt_len") or 0)
    if not prompt_len:
        raise PdtraceError(f"no prompt length recorded for {request!r} (no req.add / nixl.request_finished)")
    return {
        "request": request, "p_req": p_req, "d_req": d_req,
        "block_sizes": block_sizes, "group_kinds": kinds, "windows": list(conf.get("windows") or []),
        "draft_groups": list(conf.get("draft_groups") or []),
        "hybrid": any("Mamba" in g for g in kinds),
        "spec_method": method, "harness_method": _METHOD_MAP.get(method, "eagle" if k else ""),
        "num_spec_tokens": k,
        "num_lookahead_tokens": int(conf.get("num_lookahead_tokens") or 0),
        "async_scheduling": bool(conf.get("async_scheduling")),
        "prompt_len": prompt_len,
        "p_allocated": (rf or {}).get("allocated_block_ids") or (p_alloc or {}).get("block_ids"),
        "p_reported": (rf or {}).get("block_ids"),
        "remote_num_tokens": (rf or {}).get("remote_num_tokens"),
        "p_alloc_lookahead": (p_alloc or {}).get("num_lookahead_tokens"),
        "d_local": (ra or {}).get("local_block_ids"),
        "trim_local": (trim or {}).get("local_out"),
        "trim_remote": (trim or {}).get("remote_out"),
        "recorded_faults": faults,
    }
