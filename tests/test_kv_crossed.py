"""Issue 51: KV that never crossed (kv-never-crossed).

Real parts: vLLM's P and D Scheduler (the installed release) with the NIXL connector's scheduler
side: P's request_finished gives the params, D's get_num_new_matched_tokens / allocate_slots /
update_state_after_alloc decide what D loads; vLLM's own PrefillStats (per request: local
prefix-cache hit, external tokens, computed on D) are the oracle. The fault is the router's, not
vLLM's (pdtrace.testing.crossed_sim: the hand-over to D leaves P's params out for some requests).
"""

from __future__ import annotations

import pytest

from pdtrace.detectors import KV_NEVER_CROSSED, crossed, crossed_groups
from pdtrace.detectors.causes import group
from pdtrace.detectors.coverage import NOT_CHECKED, coverage
from pdtrace.detectors.index import feed_all

pytest.importorskip("vllm")


def _run(drop=(1, 4)):
    from pdtrace.testing.crossed_sim import dropped_params

    r = dropped_params(drop=drop)
    st = crossed.Stream()
    found = feed_all(st, r.events)
    return r, found, st.notes()


def test_every_dropped_request_is_flagged_and_none_other():
    r, found, notes = _run()
    # the oracle: vLLM's PrefillStats: D loaded nothing for exactly the dropped ones among P's
    twice = sorted(rid for rid, s in r.stats.items() if rid not in r.direct and s["external"] == 0)
    assert twice == sorted(r.dropped) == ["cross-1-D", "cross-4-D"]
    assert sorted(f.req for f in found) == twice
    for f in found:
        assert f.kind == KV_NEVER_CROSSED and f.severity == "warning"
        assert f.data["computed_on_d"] == r.stats[f.req]["computed"] == r.stats[f.req]["prompt"]
        assert f.data["p_req"] == f.req.replace("-D", "-P") and "kv_transfer_params" in f.title
    (c,) = group(found)
    assert c.mechanism == "never-crossed/no-params"


def test_the_deployment_summary_matches_vllms_own_counters():
    r, _found, notes = _run()
    pair = next(n for n in notes if n["p_inst"] == "P")
    alone = next(n for n in notes if n["p_inst"] is None)
    paired = {rid: s for rid, s in r.stats.items() if rid not in r.direct}
    assert pair["loaded"] == sum(s["external"] for s in paired.values())
    assert pair["local_hit"] == sum(s["local"] for s in paired.values())
    assert pair["computed"] == sum(s["computed"] for s in paired.values())
    assert pair["prompt_tokens"] == sum(s["prompt"] for s in paired.values())
    assert pair["no_params"] == 2 and pair["flagged"] == 2
    # a request sent to D alone is counted, not flagged: no P request prefilled its prompt
    assert (alone["requests"], alone["computed"]) == (1, r.stats[r.direct[0]]["computed"])
    assert "loaded from P" in crossed.summary_line(pair) and "D alone" in crossed.summary_line(alone)


def test_every_request_handed_over_is_clean():
    r, found, notes = _run(drop=())
    assert all(s["external"] > 0 for rid, s in r.stats.items() if rid not in r.direct)
    assert found == []
    assert next(n for n in notes if n["p_inst"] == "P")["computed"] == 0


def test_d_alone_cannot_tell_dropped_params_and_says_so():
    """D's trace without P's: a request with no params may have been sent to D alone; no finding,
    and the class is not checked (never clean), saying what P's trace would add; the requests with
    params are counted under "(P not in the trace)", never "D alone"."""
    r, _found, _notes = _run()
    d_only = [e for e in r.events if e.get("inst") in ("D", None) and e.get("pid") is not None]
    d_only = [e for e in d_only if e["ev"] != "sched.config" or e.get("kv_role") == "kv_consumer"]
    assert crossed.detect(d_only) == []
    st = crossed.Stream()
    feed_all(st, d_only)
    names = sorted(crossed.pair_name(n) for n in st.notes())
    assert names == ["(P not in the trace) -> D", "D alone (no P request of the prompt)"]
    c = coverage(d_only)[KV_NEVER_CROSSED]
    assert c.status == NOT_CHECKED and "P's trace" in c.reason


def test_a_load_shorter_than_what_p_computed():
    """SYNTHETIC shape (no release here produces it: NIXL's D loads the whole prompt past its own
    hit): the real run's events with one D admission edited to load two blocks fewer than P
    computed. The rule, not vLLM, is under test: flagged as a partial load with the tokens D
    computed again; one token short (NIXL's backoff) is not."""
    r, _found, _notes = _run(drop=())
    adm = [e for e in r.events if e["ev"] == "sched.alloc" and e.get("inst") == "D"
           and "num_external_computed_tokens" in e and e.get("req") == "cross-2-D"][0]
    ext = adm["num_external_computed_tokens"]
    adm["num_external_computed_tokens"] = ext - 1
    assert crossed.detect(r.events) == []
    adm["num_external_computed_tokens"] = ext - 32
    (f,) = crossed.detect(r.events)
    assert (f.req, f.data["mechanism"], f.data["missing"]) == ("cross-2-D", "partial-load", 32)
    assert f.title.startswith("partial load")


def test_the_drafters_groups_and_the_transfer_groups_are_recorded():
    """Issue 51 item 1 (recording; the rule is test_a_drafter_group_left_out_of_the_transfer_*): sched.config names the
    KV cache groups vLLM marks as the drafter's (KVCacheGroupSpec.is_eagle_group) and, where not
    every group transfers, KVCacheConfig.transfer_group_ids. A faithful minimal caller: the hook's
    group_layout on vLLM's own dataclasses, as Scheduler.__init__'s hook calls it."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from pdtrace.hooks.kv_layout import group_layout  # (not bare `hooks`: bench/hooks.py shadows it once a test puts bench/ on sys.path)

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=__import__("torch").float32)
    target = KVCacheGroupSpec(["model.layers.0.self_attn"], spec)
    fields = {f.name for f in dataclasses.fields(KVCacheGroupSpec)}
    if "is_eagle_group" not in fields:
        pytest.fail("this vLLM has no KVCacheGroupSpec.is_eagle_group: say how it marks the drafter's groups")
    draft = KVCacheGroupSpec(["model.layers.1.self_attn"], spec, is_eagle_group=True)
    kw = {"enable_kv_transfer": False} if "enable_kv_transfer" in fields else {}
    groups = [target, dataclasses.replace(draft, **kw)]
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    out = group_layout(groups, cfg, None)
    assert out["draft_groups"] == [1] and out["draft_layers"] == [["model.layers.1.self_attn"]]
    if kw:  # (0.33: a group can be left out of the transfer; vLLM's own property says which)
        assert out["transfer_group_ids"] == [0] == list(cfg.transfer_group_ids)
    assert "draft_groups" not in group_layout([target], KVCacheConfig(8, [], [target]), None)


def _drafter(mode):
    from pdtrace.testing.crossed_sim import drafter_group

    r = drafter_group(mode)
    return r, crossed.detect(r.events)


def test_a_drafter_group_left_out_of_the_transfer_is_an_error_per_request():
    """vLLM #54926's shape (a LABELLED FAULT: the drafter's group built with enable_kv_transfer=False, which
    0.32 / 0.33 do only for HiSparse groups). The oracle is vLLM's objects: the scheduler counted the loaded
    tokens computed (num_computed_tokens) while the blocks the connector hands its worker to load into
    (kv_connector_metadata.reqs_to_recv) hold none of the drafter group's blocks."""
    from pdtrace.testing.crossed_sim import never_written

    r, found = _drafter("kept")
    unwritten = never_written(r)
    assert unwritten == sorted(r.oracle) and len(unwritten) == 3
    assert all(o["computed"] == o["prompt"] for o in r.oracle.values())  # the whole prompt counted computed
    assert sorted(f.req for f in found) == unwritten
    for f in found:
        o = r.oracle[f.req]
        assert (f.kind, f.severity, f.data["mechanism"]) == (KV_NEVER_CROSSED, "error", "drafter-group")
        assert f.data["groups"] == [1] and f.data["layers"] == [[1, ["draft_model.layers.0.self_attn.attn"]]]
        assert f.data["unwritten"] == [0, o["computed"]] and f.data["p_req"] == f.req.replace("-D", "-P")
        assert "#54926" in f.explanation and "transfer_group_ids" in f.explanation
    (c,) = group(found)  # one headline for every request
    assert c.mechanism == "never-crossed/drafter-group" and c.severity == "error" and len(c.findings) == 3
    assert c.upstream == ["https://github.com/vllm-project/vllm/issues/54926"]
    (pair,) = [n for n in crossed.pair_notes(r.events) if n["p_inst"] == "P"]
    assert pair["drafter_unwritten"] == pair["loaded"] == sum(o["computed"] for o in r.oracle.values())
    # per group (the oracle's recv_blocks: one list, the target's group; the drafter's group not among them)
    g0, g1 = pair["groups"]
    assert all(len(o["recv_blocks"]) == 1 for o in r.oracle.values())
    assert (g0["loaded"], g0["not_transferred"], g0["transfer"]) == (pair["loaded"], 0, True)
    assert g0["blocks"] == sum(len(o["recv_blocks"][0]) for o in r.oracle.values())
    assert (g1["loaded"], g1["not_transferred"], g1["blocks"], g1["draft"]) == (0, pair["loaded"], 0, True)
    lines = crossed_groups.lines(pair["groups"])
    assert lines[0].startswith("group 1 (FullAttention, drafter): none of the 156 loaded token(s) reached it")
    assert lines[1] == "every loaded token reached group 0 (FullAttention)"


def test_a_drafter_group_that_transfers_is_clean():
    """The correct run with a separate drafter group (vLLM's default enable_kv_transfer): the connector loads
    into the drafter's group too (the oracle), and nothing is flagged."""
    r, found = _drafter("transfer")
    assert all(o["recv_blocks"][1] == o["draft_blocks"] for o in r.oracle.values()) and len(r.oracle) == 3
    assert found == []
    cfg = [e for e in r.events if e["ev"] == "sched.config"]
    assert {e["inst"] for e in cfg} == {"P", "D"} and all(e["draft_groups"] == [1] for e in cfg)
    assert all("transfer_group_ids" not in e for e in cfg)  # every group transfers
    assert all("drafter_unwritten" not in n for n in crossed.pair_notes(r.events))
    (pair,) = [n for n in crossed.pair_notes(r.events) if n["p_inst"] == "P"]
    for g, row in enumerate(pair["groups"]):  # both groups got every loaded token, in the oracle's blocks
        assert (row["loaded"], row["not_loaded"], row["not_transferred"]) == (pair["loaded"], 0, 0)
        assert row["blocks"] == sum(len(o["recv_blocks"][g]) for o in r.oracle.values())
    assert crossed_groups.lines(pair["groups"]) == [
        "every KV cache group got every loaded token: group 0 (FullAttention), group 1 (FullAttention, drafter)"]
