"""Scheduler hooks on the real vLLM 0.32.0 Scheduler / KVCacheManager (CPU, no model).

Every assertion is on values the hooks recorded while real scheduler code ran.
"""

from __future__ import annotations

import pytest

from pdtrace.record.redact import token_hash
from pdtrace.tracefile.trace import derive_block_lists

pytestmark = pytest.mark.vllm


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _one(events, kind, **match):
    found = [e for e in events if e["ev"] == kind and all(e.get(k) == v for k, v in match.items())]
    assert found, f"no {kind} event matching {match}"
    return found


def test_all_scheduler_hooks_apply(pd_harness):
    status = pd_harness.install_scheduler_hooks()
    sched = {k: v for k, v in status.items() if k.startswith("scheduler.")}
    assert set(sched) == {"scheduler.init", "scheduler.schedule", "scheduler.add_request", "scheduler.finish",
                          "scheduler.free", "scheduler.allocate_slots"}
    assert all(v == "applied" for v in sched.values()), sched


def test_engine_core_hooks_get_signature_exact_wrappers(pd_harness):
    """On the pinned vLLM every applied scheduler/NIXL hook uses the generated wrapper (the
    generic *args/**kwargs one costs ~5x more per call); a signature change that forces the
    fallback shows up here, not as a silent slowdown."""
    from pdtrace import hooks

    pd_harness.install_scheduler_hooks()
    specs = [s for s in hooks.REGISTRY.values() if s.subsystem in ("scheduler", "nixl") and s.status == "applied"]
    assert len(specs) >= 10
    slow = [s.name for s in specs if not getattr(getattr(s.owner, s.qualname.split(".")[-1]), "__pdtrace_fast__", False)]
    assert slow == []


@pytest.mark.parametrize("method,k,lookahead", [("eagle", 3, 3), ("dflash", 3, 4), ("ngram", 3, 0)])
def test_sched_config_per_instance(pd_harness, method, k, lookahead):
    cfg = pd_harness.PDConfig(spec_method=method, num_spec_tokens=k, block_size=16)
    rec = pd_harness.new_recorder()
    pair = pd_harness.make_pair(cfg, rec)
    rec.flush()
    confs = [e for e in rec.events if e["ev"] == "sched.config"]
    assert [c["inst"] for c in confs] == ["P", "D"]
    for c, role in zip(confs, ("kv_producer", "kv_consumer")):
        assert c["block_sizes"] == [16]
        assert c["group_kinds"] == ["FullAttentionSpec"]
        assert c["num_lookahead_tokens"] == lookahead
        assert c["num_spec_tokens"] == k
        assert c["spec_method"] == method
        assert c["kv_role"] == role
        assert c["connector"].startswith("Nixl")
        assert c["async_scheduling"] is False
        assert c["num_blocks"] == cfg.num_blocks
    # the schedulers carry their own instance and a step counter starting at 0
    assert (pair.p._pdtrace_inst, pair.d._pdtrace_inst) == ("P", "D")
    assert pair.p._pdtrace_step == 0 == pair.d._pdtrace_step
    roles = [e for e in rec.events if e["ev"] == "proc.role"]
    assert roles and roles[0]["new_role"] == "engine-core"


def test_hybrid_and_async_config(pd_harness):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=2, block_size=16, hybrid=True,
                              async_scheduling=True)
    rec = pd_harness.new_recorder()
    pd_harness.make_pair(cfg, rec)
    rec.flush()
    c = [e for e in rec.events if e["ev"] == "sched.config"][0]
    assert c["group_kinds"] == ["FullAttentionSpec", "MambaSpec"]
    assert c["block_sizes"] == [16, 16]
    assert c["async_scheduling"] is True


# prompt_len, block_size, k -> trailing lookahead blocks beyond the prompt's blocks on P
CASES = [
    (16, 16, 3, 1),  # block-aligned: one lookahead block
    (32, 16, 3, 1),
    (20, 16, 3, 0),  # not aligned: the lookahead fits in the last prompt block
    (16, 4, 5, 2),   # two lookahead blocks
    (16, 16, 1, 1),
]


@pytest.mark.parametrize("prompt_len,bs,k,trailing", CASES)
def test_p_allocates_lookahead_blocks(pd_harness, pd_pair, prompt_len, bs, k, trailing):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=k, block_size=bs)
    r = pd_harness.run_pd_request(cfg, prompt_len, pair=pd_pair(cfg))
    alloc = _one(r.events, "sched.alloc", inst="P", req=r.p_req)[0]
    assert alloc["ok"] is True
    assert alloc["num_computed_tokens"] == 0
    assert alloc["num_new_tokens"] == prompt_len
    assert alloc["prompt_len"] == prompt_len
    assert alloc["num_lookahead_tokens"] == k == alloc["sched_lookahead_tokens"]
    assert alloc["delay_cache_blocks"] is False
    n = len(alloc["block_ids"][0])
    assert n == cdiv(prompt_len + k, bs)
    assert n - cdiv(prompt_len, bs) == trailing
    assert alloc["new_block_ids"] == alloc["block_ids"]  # first allocation: all new
    # P frees exactly what it allocated once D's read is done
    free = _one(r.events, "sched.free", inst="P", req=r.p_req)[0]
    assert free["block_ids"] == alloc["block_ids"]


def test_d_effective_lookahead_is_zero_while_loading(pd_harness, pd_pair):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 32, pair=pd_pair(cfg))
    d_allocs = [e for e in r.events if e["ev"] == "sched.alloc" and e["req"] == r.d_req]
    loading = d_allocs[0]
    assert loading["delay_cache_blocks"] is True
    assert loading["num_lookahead_tokens"] == 0 and loading["sched_lookahead_tokens"] == 3
    assert loading["num_external_computed_tokens"] == 32
    assert len(loading["block_ids"][0]) == 2  # the 32 loaded tokens, no lookahead block
    running = d_allocs[1]
    # a running request's call that appended blocks: short event (schema v2), no full list
    assert running["num_lookahead_tokens"] == 3 and running["new_block_ids"][0]
    assert "block_ids" not in running and "delay_cache_blocks" not in running
    # the loader's derivation: block ids held grow monotonically and the first ones stay put
    assert derive_block_lists(d_allocs) >= 1 and running["block_ids_derived"] is True
    assert running["block_ids"][0][:2] == loading["block_ids"][0]
    assert running["block_ids"][0][2:] == running["new_block_ids"][0]


def test_derived_block_lists_match_what_the_scheduler_frees(pd_harness, pd_pair):
    """Long decode on real vLLM: many grow events; the list the loader derives from them
    equals the list the free hook reads from the KV cache manager (recorded independently)."""
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 40, pair=pd_pair(cfg), decode_steps=40)
    allocs = [e for e in r.events if e["ev"] == "sched.alloc" and e["req"] == r.d_req]
    grows = [e for e in allocs if "block_ids" not in e]
    assert len(grows) >= 3, [len(e.get("new_block_ids", [[]])[0]) for e in allocs]
    derive_block_lists(allocs)
    freed = [e for e in r.events if e["ev"] == "sched.free" and e["req"] == r.d_req]
    assert freed and allocs[-1]["block_ids"] == freed[0]["block_ids"]


def test_steps_are_per_scheduler_and_step_events(pd_harness, pd_pair):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=2, block_size=16)
    pair = pd_pair(cfg)
    p0, d0 = pair.p._pdtrace_step, pair.d._pdtrace_step
    r = pd_harness.run_pd_request(cfg, 20, pair=pair, decode_steps=3)
    p_steps = [e["step"] for e in r.events if e["ev"] == "sched.step" and e["inst"] == "P"]
    d_steps = [e["step"] for e in r.events if e["ev"] == "sched.step" and e["inst"] == "D"]
    assert p_steps == list(range(p0 + 1, pair.p._pdtrace_step + 1))
    assert d_steps == list(range(d0 + 1, pair.d._pdtrace_step + 1))
    p_first = [e for e in r.events if e["ev"] == "sched.step" and e["inst"] == "P"][0]
    assert p_first["tokens"] == {r.p_req: 20} and p_first["num_tokens"] == 20 and p_first["num_reqs"] == 1
    # D verifies draft tokens once they were proposed
    spec_steps = [e for e in r.events if e["ev"] == "sched.step" and e["inst"] == "D" and e.get("spec")]
    assert spec_steps and all(s["spec"][r.d_req] == 2 for s in spec_steps)
    assert all(s["tokens"][r.d_req] == 3 for s in spec_steps)
    # every event of D's request carries a D step within D's range
    for e in r.events:
        if e.get("req") == r.d_req and e["ev"].startswith("sched."):
            assert e["inst"] == "D" and d0 < e["step"] <= pair.d._pdtrace_step


def test_req_add_finish_and_redaction(pd_harness):

    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    for redact in (True, False):
        rec = pd_harness.new_recorder(redact=redact)
        r = pd_harness.run_pd_request(cfg, 20, pair=pd_harness.make_pair(cfg, rec))
        add_p = _one(r.events, "req.add", req=r.p_req)[0]
        add_d = _one(r.events, "req.add", req=r.d_req)[0]
        assert add_p["prompt_len"] == 20 and add_p["inst"] == "P"
        assert add_p["prompt_hash"] == add_d["prompt_hash"] != ""
        assert add_p["kv"]["do_remote_decode"] is True
        assert add_d["kv"]["do_remote_prefill"] is True and add_d["kv"]["n_remote_blocks"] == [2]
        assert add_d["kv"]["remote_request_id"] == r.p_req
        if redact:
            assert "prompt_ids" not in add_p
        else:
            assert len(add_p["prompt_ids"]) == 20 and token_hash(add_p["prompt_ids"]) == add_p["prompt_hash"]
        fin_p = _one(r.events, "req.finish", req=r.p_req)[0]
        assert fin_p["status"] == "FINISHED_LENGTH_CAPPED"
        assert fin_p["num_computed_tokens"] == 20 and fin_p["num_output_tokens"] == 1


def test_hook_errors_are_contained(pd_harness):
    """A recorder that fails on sched.alloc: vLLM keeps scheduling, the error is counted."""
    from pdtrace.record.recorder import Recorder

    class Failing(Recorder):
        def emit(self, kind, req=None, step=None, **fields):
            if kind == "sched.alloc":
                raise RuntimeError("boom")
            return super().emit(kind, req=req, step=step, **fields)

        def put(self, kind, req, step, fields):  # the hot-path form some hooks use
            if kind == "sched.alloc":
                raise RuntimeError("boom")
            return super().put(kind, req, step, fields)

    rec = Failing(None, threaded=False, role="engine-core")
    rec.events = []
    rec._sink = rec.events.extend
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 16, pair=pd_harness.make_pair(cfg, rec))
    assert rec.hook_errors.get("scheduler.allocate_slots", 0) >= 3
    assert not [e for e in r.events if e["ev"] == "sched.alloc"]
    errs = [e for e in r.events if e["ev"] == "hook.error"]
    assert errs and errs[0]["hook"] == "scheduler.allocate_slots" and "boom" in errs[0]["error"]
    # the request still went all the way through P and D
    assert _one(r.events, "req.finish", req=r.d_req)[0]["num_output_tokens"] >= 2


def test_plain_requests_through_a_nixl_scheduler_record_finish_and_free_not_nixl(pd_harness, pd_pair):
    """A request without kv_transfer_params on a NixlConnector-configured P scheduler (real
    vLLM): no nixl.* events for it (the connector hooks' inline skip, and the same filter in
    their before-functions), while the finish and free hooks (``before`` wrappers) record what
    the real scheduler did: the finish status and output count, and freed blocks equal to the
    list derived from the request's allocations."""
    from vllm.v1.outputs import ModelRunnerOutput

    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    pair = pd_pair(cfg)
    rec, sched = pair.rec, pair.p
    rec.flush()
    start = len(rec.events)
    with pd_harness.recording(rec):
        for i in range(3):
            sched.add_request(pd_harness._make_request(f"plain-{i}", list(range(10, 10 + 40 + i)), 5, None,
                                                       cfg.block_size))
        for _ in range(20):
            if not any(r.request_id.startswith("plain-") for r in sched.running + list(sched.waiting)):
                break
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                sampled_token_ids=[[5] for _ in ids]))
    rec.flush()
    evs = [e for e in rec.events[start:] if str(e.get("req", "")).startswith("plain-")]
    assert not [e for e in evs if e["ev"].startswith("nixl.")]
    for i in range(3):
        rid = f"plain-{i}"
        fin = _one(evs, "req.finish", req=rid, inst="P")
        assert len(fin) == 1 and fin[0]["status"] == "FINISHED_LENGTH_CAPPED"
        assert fin[0]["num_output_tokens"] == 5 and fin[0]["num_computed_tokens"] >= 40 + i
        allocs = [e for e in evs if e["ev"] == "sched.alloc" and e["req"] == rid]
        derive_block_lists(allocs)
        freed = _one(evs, "sched.free", req=rid, inst="P")
        assert freed[0]["block_ids"] == allocs[-1]["block_ids"]
        assert len(freed[0]["block_ids"][0]) >= cdiv(40 + i + 4, 16)


@pytest.mark.parametrize("sink", ["memory", "shard"])
def test_running_growth_from_scheduler_output_under_preemption(pd_harness, tmp_path, sink):
    """Real vLLM Scheduler with too few KV blocks for its requests, so running requests are
    preempted and resumed. Running requests' allocate_slots calls are not hooked one by
    one: their new blocks come from each step's SchedulerOutput (``from_output`` events).
    Checked on what real scheduler code did: every running-path event's new blocks and
    tokens match the step it came from; resumed requests record a full list again; and at
    every free (preemption and finish) the list the loader derives from the request's
    allocations equals the blocks the free hook read from the KV cache manager. With
    ``sink="shard"`` the events go through the production path (marshalled shard frame,
    read back by ``pdtrace.record.shards``)."""
    from pdtrace.record import recorder as _rec
    from pdtrace.record.recorder import Recorder
    from pdtrace.record.shards import read_shard

    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, num_blocks=24)
    if sink == "memory":
        rec = pd_harness.new_recorder()
    else:
        rec = Recorder.to_shard_dir(str(tmp_path), threaded=False)
    with pd_harness.recording(rec):
        sched = pd_harness.build_scheduler("P", cfg)
        for i in range(6):
            sched.add_request(pd_harness._make_request(f"pre-{i}", [10 + (i * 7 + j) % 900 for j in range(40)],
                                                       60, None, cfg.block_size))
        pd_harness.drive(sched, max_steps=400)  # no drafts: one token per request and step
        assert not sched.has_requests()
    rec.flush()
    if sink == "memory":
        events = rec.events
    else:
        rec.close()
        events, problems = read_shard(rec.shard_path)
        assert not problems
    assert not any(_rec.GROW in e or _rec.PROMPT in e for e in events)  # carrier keys are never written
    adds = {e["req"]: e for e in events if e["ev"] == "req.add"}
    for i in range(6):  # the prompt's tuple hash, taken by the hook, became its blake2b prompt_hash
        assert adds[f"pre-{i}"]["prompt_hash"] == token_hash([10 + (i * 7 + j) % 900 for j in range(40)])
    steps = {e["step"]: e for e in events if e["ev"] == "sched.step"}
    grows = [e for e in events if e["ev"] == "sched.alloc" and e.get("from_output")]
    assert len(grows) >= 6 * 3
    for g in grows:
        st = steps[g["step"]]
        assert g["num_new_tokens"] == st["tokens"][g["req"]] and g["num_lookahead_tokens"] == 3
        assert g["new_block_ids"][0] and "block_ids" not in g and g["t"] < st["t"]
    resumed = 0
    for i in range(6):
        rid = f"pre-{i}"
        mine = [e for e in events if e.get("req") == rid and e["ev"] in ("sched.alloc", "sched.free")]
        allocs = [e for e in mine if e["ev"] == "sched.alloc"]
        derive_block_lists(allocs)
        frees = [e for e in mine if e["ev"] == "sched.free"]
        full = [e for e in allocs if e["ok"] and not e.get("from_output") and not e.get("block_ids_derived")]
        assert len(frees) == len(full) >= 1  # each (re)scheduling ends in a free: preemption or finish
        resumed += len(full) - 1
        last = None
        for e in mine:
            if e["ev"] == "sched.alloc" and e["ok"]:
                last = e
            elif e["ev"] == "sched.free":
                assert last is not None and e["block_ids"] == last["block_ids"], rid
    assert resumed >= 1, "no request was preempted and resumed: the case under test did not happen"


def _decode_run(pd_harness, cfg, n_reqs, prompt_len, out_len, tag):
    """n_reqs requests through a real Scheduler until all finish (``pd_harness.drive``: one
    accepted draft token per step, EAGLE drafts of length k); the events recorded (without
    their times) and the recorder."""
    rec = pd_harness.new_recorder()
    with pd_harness.recording(rec):
        sched = pd_harness.build_scheduler("P", cfg)
        for i in range(n_reqs):
            sched.add_request(pd_harness._make_request(f"{tag}-{i}", [10 + (i * 7 + j) % 900 for j in range(prompt_len)],
                                                       out_len, None, cfg.block_size))
        pd_harness.drive(sched, draft_k=cfg.num_spec_tokens, max_steps=2000)
        assert not sched.has_requests()
    rec.flush()
    # "sched": the scheduler's ordinal in this process, one more for the second run
    return [{k: v for k, v in e.items() if k not in ("t", "w", "sched")} for e in rec.events], rec


@pytest.mark.parametrize("num_blocks", [4096, 60])
def test_allocate_slots_bypass_records_the_same_events(pd_harness, monkeypatch, num_blocks):
    """On a step where no request waits and the pool has more free blocks than schedule()'s
    running loop can ask for, allocate_slots runs unwrapped for that call (hooks/scheduler.py,
    ``_bypass_plan``). Real Scheduler, the same workload run with the bypass allowed and with
    it forbidden: the events recorded are the same apart from times. With a roomy pool the
    bypass engages on the decode steps; with a tight one (60 blocks: 8 requests take 7 each
    at admission, so none waits, then grow to 9 each) running requests' allocations fail
    and requests are preempted, and those failures are recorded (``ok`` false) both ways:
    the free-block bound keeps the wrapper on. (Without the bound the bypassed run misses
    the first failure and its free hook reports a hook error: checked by hand.)"""
    from pdtrace.hooks import scheduler as S

    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, num_blocks=num_blocks)
    engaged = []
    end = S._end_bypass
    monkeypatch.setattr(S, "_end_bypass", lambda plan: (engaged.append(plan), end(plan)))
    with_bypass, rec = _decode_run(pd_harness, cfg, 8, 100, 40, "byp")
    assert not rec.hook_errors
    n_engaged = len(engaged)
    monkeypatch.setattr(S, "_BOUNDED_SPECS", ())
    without, _ = _decode_run(pd_harness, cfg, 8, 100, 40, "byp")
    assert len(engaged) == n_engaged  # forbidden: never engaged
    assert with_bypass == without
    steps = sum(e["ev"] == "sched.step" for e in without)
    failed = [e for e in without if e["ev"] == "sched.alloc" and not e["ok"]]
    if num_blocks == 4096:
        assert n_engaged == steps - 1 and not failed  # every step but the first (prefill, requests waiting)
    else:  # more frees than requests: some were preempted (and freed again at their finish)
        assert failed and sum(e["ev"] == "sched.free" for e in without) > 8
