"""The report of a live P/D run (``live_cpu_pd``): event kinds per hook with counts and sample
values, processes per instance, hooks.status, and the kinds a CPU run never produces (with
the reason from vLLM's code)."""

from __future__ import annotations

import collections
import json
import os

# Kinds a live CPU run cannot produce, and why (vLLM 0.32.0 code locations). Used only for
# kinds that are really absent from the trace; anything present is reported as present.
CPU_ABSENT_REASONS: dict[str, str] = {
    "d2h.issue": "vllm/v1/worker/gpu_model_runner.py GPUModelRunner._update_states_after_model_execute "
                 "returns at once unless the model is hybrid (model_config.is_hybrid: Mamba/linear "
                 "attention); the tiny Llama is pure attention, so the num_accepted_tokens D2H copy "
                 "and its event.record() never run. (On CPU torch.Event is a placeholder anyway: "
                 "vllm/v1/worker/cpu_model_runner.py _torch_cuda_wrapper.)",
    "d2h.done": "same as d2h.issue: no D2H copy of num_accepted_tokens is ever issued",
    "acc.truth": "GPUModelRunner._get_valid_sampled_token_count is only called from the deferred "
                 "spec-decode correction of the async-scheduling path (GPUModelRunner._update_states: "
                 "deferred_spec_decode_corrections; valid_sampled_token_count_event exists only if "
                 "use_async_scheduling), and vllm/platforms/cpu.py CpuPlatform.check_and_update_config "
                 "forces scheduler_config.async_scheduling = False",
    "acc.read": "GPUModelRunner._prepare_inputs reads the CPU copy only when num_accepted_tokens_event "
                "exists (spec decode); not observed in this run",
    "spec.window": "GPUModelRunner.propose_draft_token_ids not reached (no drafter with KV, e.g. ngram)",
    "batch.swap": "InputBatch.swap_states is called only from "
                  "vllm/v1/attention/backends/utils.py reorder_batch_to_split_decodes_and_prefills, which "
                  "GPUModelRunner._may_reorder_batch runs only when an attention builder sets "
                  "reorder_batch_threshold; the CPU attention backend's CPUAttentionMetadataBuilder "
                  "(v1/attention/backends/cpu_attn.py) keeps AttentionMetadataBuilder's default None "
                  "(v1/attention/backend.py), so a CPU_ATTN model's batch is never reordered",
    "batch.condense": "InputBatch.condense moves rows only when a request finishes while a "
                      "higher row is still running; not triggered by this load",
    "fault.inject": "only emitted by test fixtures that re-introduce an old vLLM rule; never live",
    "mark": "free-form marker written by tools/tests, not by vLLM hooks",
    "hook.error": "no hook raised (good)",
}


# ----------------------------------------------------------------------------------------
# trace summary
# ----------------------------------------------------------------------------------------

_COMMON = {"ev", "t", "w", "pid", "role", "inst", "rank", "step", "req", "id", "sim"}


def _short(v, n: int = 160):
    s = json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def summarize(trace_path: str | os.PathLike) -> dict:
    from pdtrace import schema
    from pdtrace.tracefile.trace import load

    tr = load(str(trace_path), lenient=True)
    ev = tr.events
    counts = collections.Counter(e["ev"] for e in ev)
    by_inst = collections.defaultdict(collections.Counter)
    pids = collections.defaultdict(set)
    roles = collections.defaultdict(dict)
    for e in ev:
        inst = e.get("inst", "?")
        by_inst[inst][e["ev"]] += 1
        pids[inst].add(e["pid"])
        if e["ev"] == "proc.role":
            roles[inst][e["pid"]] = e.get("new_role")
        roles[inst].setdefault(e["pid"], e.get("role"))
    hooks_status = [{"inst": e.get("inst"), "pid": e["pid"], "role": e.get("role"), "vllm": e.get("vllm"),
                     "applied": e.get("applied", []), "skipped": e.get("skipped", {})}
                    for e in ev if e["ev"] == "hooks.status"]
    samples: dict[str, list[dict]] = {}
    for e in ev:
        lst = samples.setdefault(e["ev"], [])
        if len(lst) < 3:
            lst.append({k: v for k, v in e.items() if k not in _COMMON or k in ("inst", "role", "req", "step")})
    per_hook: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for k, kind in schema.KINDS.items():
        per_hook[kind.hook or "(recorder)"][k] = counts.get(k, 0)
    absent = {k: CPU_ABSENT_REASONS.get(k, "not observed in this run")
              for k in schema.KINDS if counts.get(k, 0) == 0}
    errors = [e for e in ev if e["ev"] == "hook.error"]
    exits = [{"inst": e.get("inst"), "pid": e["pid"], "role": e.get("role"), "events": e.get("events"),
              "dropped": e.get("dropped"), "hook_errors": e.get("hook_errors")}
             for e in ev if e["ev"] == "proc.exit"]
    return {"path": str(trace_path), "events": len(ev), "complete": tr.complete,
            "problems": [str(p) for p in tr.problems[:20]], "counts": dict(counts),
            "counts_by_inst": {k: dict(v) for k, v in by_inst.items()},
            "pids_by_inst": {k: sorted(v) for k, v in pids.items()},
            "roles_by_inst": {k: {str(p): r for p, r in v.items()} for k, v in roles.items()},
            "hooks_status": hooks_status, "per_hook": {k: v for k, v in per_hook.items()},
            "samples": samples, "absent": absent, "hook_errors": [
                {"pid": e["pid"], "hook": e.get("hook"), "error": e.get("error")} for e in errors[:20]],
            "proc_exits": exits}


def format_report(res: dict) -> str:
    s = res.get("summary") or {}
    L = []
    L.append(f"== live CPU P/D + {res.get('spec')} spec decode: {res.get('status')} in {res.get('total_s')}s "
             f"(servers ready: {res.get('ready_s')}) ==")
    if res.get("error"):
        L.append(f"ERROR: {res['error'][-2000:]}")
    mem = res.get("peak_rss_mb")
    if mem:
        L.append(f"peak RSS (MB, summed per process tree): {mem}")
    if "nixl_pthr_delay_set" in res:
        L.append(f"NIXL agents given a progress-thread poll delay (scripts/live_site): {res['nixl_pthr_delay_set']}")
    for r in res.get("requests", []):
        L.append(f"  req {r['name']:<22} len={r.get('len')} max_tokens={r.get('max_tokens')} ok={r.get('ok')} "
                 f"out={r.get('n_out')} {r.get('s', '')}s remote_blocks={r.get('remote_block_ids')}"
                 + (f" matches_disaggregated={r.get('matches_disaggregated')}" if 'matches_disaggregated' in r else "")
                 + (f" ERROR {r.get('error')}" if not r.get('ok') else ""))
    if not s:
        return "\n".join(L)
    L.append(f"trace {s['path']}: {s['events']} events, complete={s['complete']}, problems={len(s['problems'])}")
    for inst, p in s["pids_by_inst"].items():
        L.append(f"  instance {inst}: {len(p)} processes, roles {sorted(set(s['roles_by_inst'][inst].values()))}")
    last = {}
    for h in s["hooks_status"]:  # hooks.status is re-emitted as hooks apply lazily: keep the last per pid
        last[h["pid"]] = h
    for h in last.values():
        L.append(f"  hooks.status {h['inst']} pid {h['pid']} ({h['role']}): applied {len(h['applied'])} "
                 f"{h['applied']} skipped {h['skipped']}")
    L.append("event kinds per hook (count total; by instance):")
    for hook, kinds in sorted(s["per_hook"].items()):
        L.append(f" [{hook}]")
        for k, n in kinds.items():
            if n:
                split = {i: c[k] for i, c in s["counts_by_inst"].items() if c.get(k)}
                ex = s["samples"].get(k, [])[:2]
                L.append(f"    {k:<22} {n:>6} {split}  e.g. {_short(ex, 260)}")
    L.append("kinds absent from the live CPU trace (why):")
    for k, why in s["absent"].items():
        L.append(f"    {k:<22} {why}")
    if s["hook_errors"]:
        L.append(f"hook errors: {s['hook_errors']}")
    chk = res.get("check") or {}
    L.append(f"pdtrace check: rc={chk.get('rc')} findings={chk.get('by_kind')} {chk.get('error', '')}")
    return "\n".join(L)
