"""KV that never crossed, at engine-core level on vLLM's real schedulers (issue 51).

What is real: P's and D's ``Scheduler`` with the NIXL connector's scheduler side
(``pd_harness``): P prefills each prompt for a remote decode and returns its kv_transfer_params
(``request_finished``); D's scheduler asks its connector how many tokens it would load
(``get_num_new_matched_tokens``), allocates, and schedules the rest of the prompt itself; vLLM's
own ``PrefillStats`` say per request how many prompt tokens came from D's prefix cache, from the
transfer, and were computed on D.

What is pdtrace's (a labelled FAULT, the router's, not vLLM's): for the requests ``drop`` names,
the hand-over to D leaves the kv_transfer_params out (the shape of smg PR #1622: its gRPC path
never passed NIXL's parameters to D). Simulated: the NIXL read itself (D's load completes in the
next step, as ``pd_harness`` does) and the sampled tokens.

The oracle is vLLM's own objects, never the detector: each D request's ``PrefillStats``
(``num_local_cached_tokens``, ``num_external_cached_tokens``, ``num_computed_tokens``) from the
outputs D's ``update_from_output`` returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .kv_load_sim import run_events
from .pd_harness import PDConfig, make_pair, recording
from .pd_steps import _make_request, _mro, p_prefill


@dataclasses.dataclass
class Crossed:
    events: list[dict]
    dropped: list[str]  # D request ids whose params the hand-over left out (the fault)
    stats: dict[str, dict]  # D request -> vLLM's PrefillStats: prompt, local, external, computed
    direct: list[str]  # D requests sent to D alone (no P request): not disaggregated, not a fault


def _stats_of(eco: dict, into: dict, prompt_len: dict) -> None:
    """vLLM's own numbers per request, from its first output: ``PrefillStats`` (0.20+); 0.19's
    output carries only ``num_cached_tokens`` (local + external, not split: ``None`` there)."""
    for outs in eco.values():
        for o in outs.outputs:
            if o.request_id in into:
                continue
            ps = getattr(o, "prefill_stats", None)
            if ps is not None:
                into[o.request_id] = {"prompt": ps.num_prompt_tokens, "local": ps.num_local_cached_tokens,
                                      "external": ps.num_external_cached_tokens, "computed": ps.num_computed_tokens}
            elif isinstance(getattr(o, "num_cached_tokens", None), int) and o.num_cached_tokens >= 0:
                n = prompt_len[o.request_id]
                into[o.request_id] = {"prompt": n, "local": None, "external": None,
                                      "computed": n - o.num_cached_tokens}


def _run_d(d: Any, d_req: str, steps: int = 12) -> Any:
    """D's scheduler stepped until ``d_req`` leaves it: yields each step's SchedulerOutput and what
    ``update_from_output`` returned (a prompt's last step samples one token; a pending load completes
    the next step)."""
    for _ in range(steps):
        if d_req not in d.requests:
            return
        out = d.schedule()
        toks = {rid: [300] if d.requests[rid].num_computed_tokens >= d.requests[rid].num_prompt_tokens else []
                for rid in out.num_scheduled_tokens}
        loaded = {rid for rid, r in d.requests.items() if r.status.name == "WAITING_FOR_REMOTE_KVS"}
        yield out, d.update_from_output(out, _mro(out, toks, finished_recving=loaded or None))


def dropped_params(n: int = 6, drop: tuple[int, ...] = (1, 4), direct: int = 1, prompt_len: int = 45,
                   block_size: int = 16, tag: str = "cross") -> Crossed:
    """``n`` prompts P prefills for a remote decode, handed to D with P's params except those of
    ``drop`` (indices); then ``direct`` requests sent to D alone (no P, no params). D runs each to
    the end of its 4 output tokens."""
    cfg = PDConfig(spec_method="", block_size=block_size)
    pair = make_pair(cfg)
    rec, d = pair.rec, pair.d
    rec.flush()
    start = len(rec.events or [])
    stats: dict[str, dict] = {}
    dropped, direct_ids = [], []
    lens: dict[str, int] = {}
    with recording(rec):
        rec.emit("mark", label="scenario", sim=True,
                 detail=f"dropped_params n={n} drop={drop} direct={direct} prompt_len={prompt_len} (FAULT: the "
                        f"hand-over to D leaves the kv_transfer_params of the dropped ones out)")
        for i in range(n + direct):
            prompt = [2000 + 97 * i + j for j in range(prompt_len + i)]
            d_req = f"{tag}-{i}-D"
            lens[d_req] = len(prompt)
            if i < n:
                params = p_prefill(pair.p, f"{tag}-{i}-P", prompt, block_size)
                kv = None if i in drop else dict(params)
                if kv is None:
                    dropped.append(d_req)
                    rec.emit("fault.inject", req=d_req, rule="router-drops-kv-transfer-params", sim=True, inst="D",
                             detail=f"the hand-over to D leaves out the kv_transfer_params P returned for {d_req} "
                                    f"(the router's fault, smg PR #1622's shape; not vLLM's code)")
            else:
                kv = None
                direct_ids.append(d_req)
            d.add_request(_make_request(d_req, prompt, 4, kv, block_size))
            for _out, eco in _run_d(d, d_req):
                _stats_of(eco, stats, lens)
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    return Crossed(run_events(pair, start), dropped, stats, direct_ids)


def prefilled_again(r: Crossed) -> list[str]:
    """The oracle: D requests P prefilled whose prompt D computed whole (vLLM's own numbers)."""
    return sorted(rid for rid, s in r.stats.items() if rid not in r.direct and s["computed"] >= s["prompt"] - 1)


def scenario(drop: tuple[int, ...]) -> Any:
    """The sample pair's builder (``scenarios.SCENARIOS``): expected findings from vLLM's own
    PrefillStats (a request P prefilled whose D side computed the prompt itself), never from the
    detector."""
    def build() -> Any:
        from pdtrace.detectors.base import KV_NEVER_CROSSED

        from .scenario_builders import Scenario, _no_read

        r = dropped_params(drop=drop)
        twice = prefilled_again(r)
        assert sorted(twice) == sorted(r.dropped), ("oracle: vLLM's PrefillStats", twice, r.dropped)
        return Scenario("", "", r.events, [KV_NEVER_CROSSED] if twice else [], {
            "real": ["vLLM 0.32.0 P and D Scheduler with the NIXL connector's scheduler side (request_finished, "
                     "get_num_new_matched_tokens, update_state_after_alloc), D's prefix cache, PrefillStats"],
            "simulated": ["the NIXL read (D's load completes the next step)", "the sampled tokens"],
            "faults": [f"the hand-over to D leaves P's kv_transfer_params out for {', '.join(r.dropped)} (the "
                       f"router's fault, smg PR #1622's shape; not vLLM's code)"] if r.dropped else [],
            "fixture": [], "own_bug": "",
            "clean_twin": "" if r.dropped else "the same requests, every one handed to D with P's params",
            "facts": {"prefill_stats": r.stats, "dropped": r.dropped, "sent_to_d_alone": r.direct},
        }, _no_read(r.events))
    return build


@dataclasses.dataclass
class DrafterGroup:
    events: list[dict]
    oracle: dict[str, dict]  # D request -> vLLM's own objects (below)


def drafter_group(draft_group: str = "kept", n: int = 3, prompt_len: int = 45, block_size: int = 16,
                  tag: str = "draft") -> DrafterGroup:
    """vLLM #54926's shape on the real schedulers: the drafter has a KV cache group of its own
    (``KVCacheGroupSpec.is_eagle_group``, as vLLM marks an MTP / draft model's group) and, with
    ``draft_group="kept"``, that group is left out of the transfer (``enable_kv_transfer=False``: a
    LABELLED FAULT; vLLM 0.32 / 0.33 turn the flag off only for HiSparse groups, main after #51718 /
    #53779 for draft-model groups). ``"transfer"``: vLLM's default, every group transfers (the
    correct run). ``n`` prompts P prefills for a remote decode, each handed to D with P's params.

    The oracle per D request, from vLLM's objects (never the detector): ``computed``, the request's
    ``num_computed_tokens`` once the load is done (the scheduler's count, for every group);
    ``draft_blocks``, D's blocks of the drafter's group for it (``kv_cache_manager.get_block_ids``);
    ``recv_blocks``, the blocks the connector hands its worker to load into
    (``kv_connector_metadata.reqs_to_recv[req].local_block_ids``, per transfer group)."""
    cfg = PDConfig(spec_method="eagle", block_size=block_size, draft_group=draft_group)
    pair = make_pair(cfg)
    rec, d = pair.rec, pair.d
    rec.flush()
    start = len(rec.events or [])
    oracle: dict[str, dict] = {}
    gid = len(cfg.attn)  # the drafter's group follows the target's
    with recording(rec):
        rec.emit("mark", label="scenario", sim=True, detail=f"drafter_group draft_group={draft_group} n={n}")
        if draft_group == "kept":
            for inst in ("P", "D"):
                rec.emit("fault.inject", rule="draft-group-not-transferred", sim=True, inst=inst,
                         detail=f"KVCacheGroupSpec(enable_kv_transfer=False) for the drafter's group {gid} "
                                f"(vLLM #54926's shape; not what 0.32 / 0.33 build)")
        for i in range(n):
            prompt = [3000 + 89 * i + j for j in range(prompt_len + 7 * i)]
            d_req = f"{tag}-{i}-D"
            params = p_prefill(pair.p, f"{tag}-{i}-P", prompt, block_size)
            d.add_request(_make_request(d_req, prompt, 4, dict(params), block_size))
            o = oracle[d_req] = {"prompt": len(prompt), "recv_blocks": None, "computed": None}
            for out, _eco in _run_d(d, d_req):
                meta = getattr(out.kv_connector_metadata, "reqs_to_recv", {}) or {}
                if d_req in meta:
                    o["recv_blocks"] = [list(g) for g in meta[d_req].local_block_ids]
                    o["draft_blocks"] = list(d.kv_cache_manager.get_block_ids(d_req)[gid])
                r = d.requests.get(d_req)
                if r is not None and o["computed"] is None and r.status.name != "WAITING_FOR_REMOTE_KVS":
                    o["computed"] = r.num_computed_tokens  # once the load is done: the scheduler's count
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    return DrafterGroup(run_events(pair, start), oracle)


def never_written(r: DrafterGroup) -> list[str]:
    """The oracle: D requests whose loaded tokens the scheduler counted computed while none of the drafter group's
    blocks is among those the connector loads into (vLLM's objects, recorded by ``drafter_group``)."""
    return sorted(req for req, o in r.oracle.items()
                  if o["computed"] and not set(o["draft_blocks"]) & {b for g in o["recv_blocks"] for b in g})


def drafter_scenario(draft_group: str) -> Any:
    """The drafter-group sample pair's builder: expected findings from vLLM's objects (the drafter's blocks
    outside what the connector loads, the tokens counted computed), never from the detector."""
    def build() -> Any:
        from pdtrace.detectors.base import KV_INVARIANT, KV_NEVER_CROSSED

        from .scenario_builders import Scenario, _no_read

        r = drafter_group(draft_group)
        unwritten = never_written(r)
        assert (draft_group == "kept") == bool(unwritten), ("oracle: reqs_to_recv vs the drafter's blocks", r.oracle)
        # (the drafter reads blocks no transfer wrote: the invariant's error too, issue 59)
        return Scenario("", "", r.events, [KV_NEVER_CROSSED, KV_INVARIANT] if unwritten else [], {
            "real": ["vLLM's P and D Scheduler with the NIXL connector's scheduler side (request_finished, "
                     "get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta) over a KV cache "
                     "config with a drafter group of its own (KVCacheGroupSpec.is_eagle_group)"],
            "simulated": ["the NIXL read (D's load completes the next step)", "the sampled tokens"],
            "faults": ["the drafter's KV cache group built with enable_kv_transfer=False on P and D (vLLM #54926's "
                       "shape; 0.32 / 0.33 do so only for HiSparse groups)"] if unwritten else [],
            "fixture": [], "own_bug": "",
            "clean_twin": "" if unwritten else "the same requests with vLLM's default: every group transfers",
            "facts": {"oracle": r.oracle, "unwritten": unwritten},
            # EAGLE with no worker simulated: the two worker-side drafter classes have no events to read
        }, ["connector-metadata-cleared-before-drafter", "drafter-window-outside-allocation", *_no_read(r.events)])
    return build
