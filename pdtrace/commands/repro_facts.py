"""The recorded facts `pdtrace repro --cause N` rebuilds, per mechanism (issue 61): read from the trace's events (the
scheduler's config, requests, allocations, the failed-load events) and the cause's first finding, which names the
request and the step. Each returns a dict for ``repro_standalone``, or raises PdtraceError (one line) when the trace
lacks what the test needs. Reads traces only."""

from __future__ import annotations

from typing import Any

from pdtrace.errors import PdtraceError


def _first(events: list[dict], kind: str, **m: Any) -> dict | None:
    for e in events:
        if e["ev"] == kind and all(e.get(k) == v for k, v in m.items()):
            return e
    return None


def _config(events: list[dict], inst: str | None, trace: str, n: int) -> dict[str, Any]:
    conf = _first(events, "sched.config", inst=inst) if inst else None
    conf = conf or _first(events, "sched.config")
    if not conf:
        raise PdtraceError(f"{trace}: cause {n}: the trace has no sched.config event (scheduler hooks were not "
                           f"applied): cannot tell block size or speculative method")
    kinds = list(conf.get("group_kinds") or ["FullAttentionSpec"])
    return {"block_sizes": list(conf.get("block_sizes") or [16]), "group_kinds": kinds,
            "hybrid": any("Mamba" in g for g in kinds), "spec_method": conf.get("spec_method") or "",
            "num_spec_tokens": int(conf.get("num_spec_tokens") or 0),
            "async_scheduling": bool(conf.get("async_scheduling")), "kv_role": conf.get("kv_role") or "kv_both"}


def _added(events: list[dict], req: str, inst: str | None, trace: str, n: int) -> dict:
    add = _first(events, "req.add", req=req, inst=inst) or _first(events, "req.add", req=req)
    if not add or not add.get("prompt_len"):
        raise PdtraceError(f"{trace}: cause {n}: no req.add with a prompt length for {req!r}: cannot rebuild its "
                           f"prompt")
    return add


def _need(finding: Any, trace: str, n: int) -> Any:
    if finding is None or not finding.req:
        raise PdtraceError(f"{trace}: cause {n}: its first finding names no request: nothing to rebuild")
    return finding


def drafter_window(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """The DFlash drafter's window after a request's first prefill (seed 003)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    if d.get("method") != "dflash":
        raise PdtraceError(f"{trace}: cause {n}: the drafter window of {d.get('method') or 'this drafter'!r} cannot "
                           f"be rebuilt yet: repro rebuilds DFlash's (k + 1 slots after the prompt) so far")
    s = _config(events, f.inst, trace, n)
    add = _added(events, f.req, f.inst, trace, n)
    if int(d.get("start", -1)) != int(add["prompt_len"]):
        raise PdtraceError(f"{trace}: cause {n}: the window starts at position {d.get('start')}, not after the "
                           f"{add['prompt_len']}-token prompt: repro rebuilds the window of a first prefill so far")
    return {**s, "req": f.req, "inst": f.inst or "?", "prompt_len": int(add["prompt_len"])}


def rollback(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """A running request's loaded blocks reported failed under async scheduling (vLLM #49250 / #45138)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    step = d.get("rollback_step")
    kr = [e for e in events if e["ev"] == "kvload.request" and e.get("req") == f.req and e.get("inst") == f.inst
          and (step is None or e.get("step") == step)]
    if not kr:
        raise PdtraceError(f"{trace}: cause {n}: no kvload.request event for {f.req!r}: the failure's handling was "
                           f"not recorded")
    k = kr[0]
    if k.get("status") != "RUNNING":
        raise PdtraceError(f"{trace}: cause {n}: {f.req!r} failed while {k.get('status')}: repro rebuilds a running "
                           f"request's failed blocks so far")
    handled = _first(events, "kvload.handled", inst=f.inst, step=k.get("step")) or {}
    blocks = list((k.get("block_ids") or [[]])[0])
    failed = [blocks.index(b) for b in handled.get("block_ids") or [] if b in blocks]
    if not failed:
        raise PdtraceError(f"{trace}: cause {n}: none of the failed block ids is in {f.req!r}'s block list: cannot "
                           f"tell which of its blocks failed")
    add = _added(events, f.req, f.inst, trace, n)
    if not (add.get("kv") or {}).get("do_remote_prefill"):
        raise PdtraceError(f"{trace}: cause {n}: {f.req!r} did not load its KV from P: repro rebuilds a request "
                           f"loaded from P so far")
    s = _config(events, f.inst, trace, n)
    if not s["async_scheduling"]:
        raise PdtraceError(f"{trace}: cause {n}: recorded without async scheduling, where no output placeholder "
                           f"exists: nothing to rebuild")
    return {**s, "req": f.req, "p_req": _p_of(events, f.req, add), "prompt_len": int(add["prompt_len"]),
            "max_tokens": int(add.get("max_tokens") or 8),
            "failed_indexes": sorted(set(failed)), "n_blocks": len(blocks),
            "placeholders": int(k.get("placeholders_before") or 0)}


def shared_block(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """Failed blocks shared through D's prefix cache, read by the second request before the first rewrites them."""
    f = _need(finding, trace, n)
    d = f.data or {}
    r1, r2, step = d.get("recomputer"), f.req, d.get("report_step")
    if not r1 or step is None:
        raise PdtraceError(f"{trace}: cause {n}: the finding names no recomputing request or failure step")
    k1 = _first(events, "kvload.request", req=r1, inst=f.inst, step=step)
    handled = _first(events, "kvload.handled", inst=f.inst, step=step)
    if not k1 or not handled:
        raise PdtraceError(f"{trace}: cause {n}: the failure's handling at step {step} was not recorded")
    b1 = list((k1.get("block_ids") or [[]])[0])
    failed = sorted({b1.index(b) for b in handled.get("block_ids") or [] if b in b1})
    a1, a2 = _added(events, r1, f.inst, trace, n), _added(events, r2, f.inst, trace, n)
    first2 = _first(events, "sched.alloc", req=r2, inst=f.inst) or {}
    shared = int(first2.get("num_new_computed_tokens") or 0)
    if not shared or not failed:
        raise PdtraceError(f"{trace}: cause {n}: {r2!r} took no blocks from D's prefix cache, or no failed block is "
                           f"{r1!r}'s: the sharing cannot be rebuilt")
    steps = [e for e in events if e["ev"] == "sched.step" and e.get("inst") == f.inst]
    after = [(e.get("tokens") or {}).get(r1, 0) for e in steps if e.get("step", 0) > step]
    left = int(k1.get("num_tokens") or 0) - int(k1.get("computed") or 0)
    conf = _first(events, "sched.config", inst=f.inst) or {}
    recorded = "long_prefill_token_threshold" in conf and "max_num_batched_tokens" in conf  # (since 2026-12-07)
    # (older traces: as the steps show them, the recompute's chunk and the most tokens a step took)
    chunk = int(conf["long_prefill_token_threshold"]) if recorded else max(after, default=0)
    chunk = chunk if 0 < chunk < left else 0  # recomputed in one step: vLLM's default, no threshold
    budget = (int(conf["max_num_batched_tokens"]) if recorded
              else max([int(e.get("num_tokens") or 0) for e in steps] + [chunk, 16]))
    return {**_config(events, f.inst, trace, n), "r1": r1, "r2": r2, "r1_len": int(a1["prompt_len"]),
            "r2_len": int(a2["prompt_len"]), "r1_max_tokens": int(a1.get("max_tokens") or 16),
            "r2_max_tokens": int(a2.get("max_tokens") or 16), "shared_tokens": shared, "failed_indexes": failed,
            "chunk": chunk, "max_num_batched_tokens": budget,
            "steps_before": max(0, int(step) - int(a2.get("step") or 0) - 1)}


def stale_read(events: list[dict], finding: Any, trace: str, n: int, mechanism: str) -> dict[str, Any]:
    """A decode that read another row's accepted count after the InputBatch rows moved (seed 004, vLLM #51571)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    conf = _first(events, "sched.config") or {}
    kinds = list(conf.get("group_kinds") or ["FullAttentionSpec"])
    sizes = list(conf.get("block_sizes") or [16])
    attn = [b for b, g in zip(sizes, kinds) if "Mamba" not in g] or [16]
    k = int(conf.get("num_spec_tokens") or 0) or 3
    if "row-moved" not in (d.get("reasons") or ["row-moved"]):
        raise PdtraceError(f"{trace}: cause {n}: the read named no row move ({', '.join(d.get('reasons') or [])}): "
                           f"repro rebuilds a read after InputBatch row moves so far")
    prev = d.get("mapping") == "prev" or mechanism.endswith("/prev")
    return {"req": f.req, "row": d.get("row"), "value": d.get("value"), "own": d.get("own") or d.get("truth"),
            "spec_method": conf.get("spec_method") or "?", "num_spec_tokens": k, "block_size": int(attn[0]),
            "async_scheduling": bool(conf.get("async_scheduling", True)), "mamba_cache_mode": "align" if prev
            else "none"}


def _small_pool(events: list[dict], f: Any, trace: str, n: int) -> int:
    """D's pool size, when small enough that the next allocation takes the blocks just freed (as under load)."""
    conf = _first(events, "sched.config", inst=f.inst) or {}
    nb = int(conf.get("num_blocks") or 0)
    if not nb or nb > 64:
        raise PdtraceError(f"{trace}: cause {n}: D's pool of {nb or '?'} blocks: repro rebuilds a pool small enough "
                           f"that the next allocation takes the blocks just freed (as under load) so far")
    return nb


def _p_of(events: list[dict], d_req: str, add: dict, named: Any = None) -> str:
    """P's request id for D's ``d_req``: as the finding names it, else vLLM's remote_request_id."""
    ra = _first(events, "nixl.remote_alloc", req=d_req) or {}
    return str(named or ra.get("remote_req") or (add.get("kv") or {}).get("remote_request_id") or "p-req")


def in_flight_write(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """A request's KV load handed blocks a step in flight still writes for a request that stopped (vLLM #37285)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    a, b = d.get("writer"), f.req
    fin = _first(events, "req.finish", req=a, inst=f.inst) or {}
    if not a or fin.get("status") != "FINISHED_STOPPED":
        raise PdtraceError(f"{trace}: cause {n}: the writer {a!r} did not stop on a stop token in the trace: repro "
                           f"rebuilds a request that stops with its next step in flight so far")
    s, nb = _config(events, f.inst, trace, n), _small_pool(events, f, trace, n)
    aa, ab = _added(events, a, f.inst, trace, n), _added(events, b, f.inst, trace, n)
    return {**s, "a": a, "b": b, "p": _p_of(events, b, ab, d.get("p_req")), "a_len": int(aa["prompt_len"]),
            "a_max_tokens": int(aa.get("max_tokens") or 32), "stop_at": int(fin.get("num_output_tokens") or 3),
            "b_len": int(ab["prompt_len"]), "num_blocks": nb, "max_model_len": (nb - 1) * s["block_sizes"][0]}


def in_flight_read(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """A sliding-window block pruned while a step in flight still reads it, handed to a KV load (vLLM #47282)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    a, b = f.req, d.get("loader")
    if not b or not d.get("window"):
        raise PdtraceError(f"{trace}: cause {n}: the finding names no loading request or window")
    s, nb = _config(events, f.inst, trace, n), _small_pool(events, f, trace, n)
    aa, ab = _added(events, a, f.inst, trace, n), _added(events, b, f.inst, trace, n)
    return {**s, "a": a, "b": b, "p": _p_of(events, b, ab), "a_len": int(aa["prompt_len"]),
            "a_max_tokens": int(aa.get("max_tokens") or 64), "b_len": int(ab["prompt_len"]), "num_blocks": nb,
            "window": int(d["window"])}


def in_flight_token(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """The token a step in flight at a KV-load rollback sampled, appended after it (engine order, async)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    s = rollback(events, finding, trace, n)  # (the same recorded facts: prompt, failed indexes, P's id)
    steps = [e.get("step") for e in events if e["ev"] == "sched.step" and e.get("inst") == f.inst
             and f.req in (e.get("tokens") or {})]
    rb, fl = d.get("rollback_step"), d.get("in_flight_step")
    if rb not in steps or fl is None:
        raise PdtraceError(f"{trace}: cause {n}: the rollback's step is not among {f.req!r}'s scheduled steps: the "
                           f"engine order cannot be rebuilt")
    return {**s, "report_at": steps.index(rb), "in_flight": int(fl), "report_step": int(fl) - 1, "first_step": steps[0],
            "steps": max(10, steps.index(rb) + 8)}


def drafter_group(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """The drafter's KV cache group left out of the transfer groups on a loading D (vLLM #54926's shape): D's recorded
    groups (layers, the drafter's mark, whether each transfers) and the request P prefilled for it."""
    f = _need(finding, trace, n)
    conf = _first(events, "sched.config", inst=f.inst) or {}
    s = _config(events, f.inst, trace, n)
    kinds, sizes = s["group_kinds"], s["block_sizes"]
    transfer, drafter = conf.get("transfer_group_ids"), set(conf.get("draft_groups") or [])
    if transfer is None:
        raise PdtraceError(f"{trace}: cause {n}: D's sched.config names no transfer_group_ids: the trace does not say "
                           f"which KV cache groups transfer")
    if set(kinds) != {"FullAttentionSpec"} or len(set(sizes)) != 1:
        raise PdtraceError(f"{trace}: cause {n}: D's KV cache groups are {', '.join(kinds)} with block sizes {sizes}: "
                           f"repro rebuilds full-attention groups of one block size so far")
    layers = {int(g): list(ls) for g, ls in zip(conf.get("draft_groups") or [], conf.get("draft_layers") or [])}
    groups = [{"layers": layers.get(g) or [f"model.layers.{g}.self_attn.attn"], "eagle": g in drafter,
               "transfer": g in set(transfer)} for g in range(len(kinds))]
    add = _added(events, f.req, f.inst, trace, n)
    return {**s, "groups": groups, "req": f.req, "p_req": _p_of(events, f.req, add, (f.data or {}).get("p_req")),
            "prompt_len": int(add["prompt_len"])}


def metadata_cleared(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """The KV connector metadata cleared before the drafter's forward on an instance that saves KV (vLLM #34529's
    order): the recorded drafter, its layers that saved nothing, the target's that did, and the request's prompt."""
    if finding is None:
        raise PdtraceError(f"{trace}: cause {n}: its first finding is not in the trace's findings: nothing to rebuild")
    d = finding.data or {}
    s = _config(events, finding.inst, trace, n)
    if not s["spec_method"] or s["spec_method"] in ("ngram", "dflash"):
        raise PdtraceError(f"{trace}: cause {n}: recorded with speculative method {s['spec_method'] or 'none'!r}: "
                           f"repro rebuilds the metadata order with an EAGLE-like drafter so far")
    reqs = list(d.get("reqs") or ([finding.req] if finding.req else []))
    add = next((a for a in (_first(events, "req.add", req=r, inst=finding.inst) for r in reqs) if a), None) or {}
    return {**s, "inst": finding.inst or "?", "step": finding.step, "req": reqs[0] if reqs else "?",
            "prompt_len": int(add.get("prompt_len") or 16), "max_tokens": max(2, int(add.get("max_tokens") or 2)),
            "target_layers": list(d.get("target_layers_saved") or []),
            "drafter_layers": list(d.get("drafter_layers_not_saved") or []), "n_save": d.get("n_save")}


def _ids(block_ids: Any) -> list[int]:
    ids = list(block_ids or [])
    return [b for g in ids for b in g] if ids and isinstance(ids[0], (list, tuple)) else ids


def expired_lease(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """P's NIXL lease on a request ran out before D read it, and P gave its blocks to another request (vLLM
    #52234): P's request and prompt, the lease (P's nixl.request_finished to its nixl.lease_expired, whole seconds),
    the first request P allocated one of those blocks to after freeing them, and a pool that makes the next request
    wait for them."""
    f = _need(finding, trace, n)
    d = f.data or {}
    p_req, p_inst = d.get("p_req"), d.get("p_inst")
    fin = _first(events, "nixl.request_finished", req=p_req, inst=p_inst)
    exp = _first(events, "nixl.lease_expired", req=p_req, inst=p_inst)
    if not fin or not exp:
        raise PdtraceError(f"{trace}: cause {n}: P's nixl.request_finished or nixl.lease_expired of {p_req!r} is not "
                           f"in the trace: the lease cannot be rebuilt")
    held = set(_ids(fin.get("block_ids")))
    free = next((i for i, e in enumerate(events) if e["ev"] == "sched.free" and e.get("req") == p_req
                 and e.get("inst") == p_inst), None)
    other = next((e for e in events[free or 0:] if free is not None and e["ev"] == "sched.alloc"
                  and e.get("inst") == p_inst and e.get("req") != p_req and held & set(_ids(e.get("block_ids")))),
                 None)
    if other is None:
        raise PdtraceError(f"{trace}: cause {n}: no request of P's took a block of {p_req!r} after P freed them: the "
                           f"re-owner cannot be rebuilt")
    s = _config(events, p_inst, trace, n)
    add, oadd = _added(events, p_req, p_inst, trace, n), _added(events, other["req"], p_inst, trace, n)
    bs, k = s["block_sizes"][0], s["num_spec_tokens"]
    h = -(-(int(add["prompt_len"]) + k) // bs)
    o = -(-(int(oadd["prompt_len"]) + k) // bs)
    lease = max(1, round((exp["t"] - fin["t"]) / 1e9))
    return {**s, "p_req": p_req, "d_req": f.req, "held_len": int(add["prompt_len"]), "blocks": sorted(held),
            "other": other["req"], "other_len": int(oadd["prompt_len"]), "lease_s": lease,
            "retrieved": int(exp.get("retrieved") or 0), "read_after_s": d.get("read_after_s"),
            "num_blocks": 1 + max(h, o)}


def lookahead_groups(s: dict, trace: str, n: int) -> list[dict] | None:
    """The recorded KV cache groups where there are several (full attention, sliding windows and chunked-local
    attention of one block size, as Gemma 3 and Llama 4 have), for the written test to build as recorded (``window``:
    a sliding window's tokens, ``chunk``: a chunked-local group's); None for one group."""
    kinds, sizes, windows = s["group_kinds"], s["block_sizes"], s.get("windows") or []
    if len(kinds) < 2:
        return None
    known = {"FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec"}
    if not set(kinds) <= known or len(set(sizes)) != 1 or len(windows) != len(kinds):
        raise PdtraceError(f"{trace}: cause {n} was recorded with {len(kinds)} KV cache groups ({', '.join(kinds)}; "
                           f"block sizes {sizes}): repro rebuilds full-attention, sliding-window and "
                           f"chunked-local groups of one block size, with their windows recorded, so far")
    drafter = set(s.get("draft_groups") or [])
    return [{"layers": [f"model.layers.{g}.self_attn.attn"], "window": int(w or 0) if k == "SlidingWindowSpec" else 0,
             "chunk": int(w or 0) if k == "ChunkedLocalAttentionSpec" else 0, "eagle": g in drafter, "transfer": True}
            for g, (k, w) in enumerate(zip(kinds, windows))]


def past_p(events: list[dict], finding: Any, trace: str, n: int) -> dict[str, Any]:
    """D's blocks to load reach past the tokens P computed (vLLM #50558): D's prompt longer than P's (a proxy
    appended P's first token), and the blocks D's own prefix cache held (its first allocation's computed tokens)."""
    f = _need(finding, trace, n)
    d = f.data or {}
    p_req, d_req = d.get("p_req"), d.get("d_req")
    if not p_req or not d_req:
        raise PdtraceError(f"{trace}: cause {n}: the finding names no P and D request")
    pa, da = _added(events, p_req, None, trace, n), _added(events, d_req, None, trace, n)
    p_len, d_len = int(pa["prompt_len"]), int(da["prompt_len"])
    if d_len <= p_len:
        raise PdtraceError(f"{trace}: cause {n}: D's prompt ({d_len} tokens) is not longer than P's ({p_len}): repro "
                           f"rebuilds D's blocks past P's tokens from a longer D prompt (vLLM #50558) so far")
    s = _config(events, da.get("inst"), trace, n)
    alloc = _first(events, "sched.alloc", req=d_req) or {}
    cached = int(alloc.get("num_new_computed_tokens") or 0) // s["block_sizes"][0]
    return {**s, "p_req": p_req, "d_req": d_req, "p_len": p_len, "d_len": d_len, "d_cached_blocks": cached}
