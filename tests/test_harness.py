"""The P/D harness itself: clean and faulted runs side by side on real vLLM scheduler code,
scenario traces that load cleanly, and the DFlash lookahead fault (seed 003)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_clean_and_buggy_side_by_side_trace(pd_harness, pd_pair, tmp_path):
    from pdtrace.tracefile.trace import load

    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    clean = pd_harness.run_pd_request(cfg, 16, pair=pd_pair(cfg))
    buggy = pd_harness.run_pd_request(cfg, 16, pair=pd_pair(cfg), faults=["old_p_block_rule"])
    assert clean.faults == () and buggy.faults == ("old_p_block_rule",)
    assert clean.p_reported == [clean.p_allocated[0][:1]]
    assert buggy.p_reported == buggy.p_allocated and len(buggy.p_allocated[0]) == 2
    assert clean.trim_remote == [clean.p_allocated[0][:1]]
    assert buggy.trim_remote == [buggy.p_allocated[0][1:2]]  # shifted: D block 0 <- P's lookahead block
    # the fault is scoped to its run: the next clean run reports clipped blocks again
    again = pd_harness.run_pd_request(cfg, 16, pair=pd_pair(cfg))
    assert len(again.p_reported[0]) == 1

    path = tmp_path / "side_by_side.jsonl"
    pd_harness.write_scenario_trace(str(path), clean.events + buggy.events[len(pd_pair(cfg).setup_events):])
    t = load(str(path))
    assert t.problems == [] and t.header["origin"] == "scenario" and t.header["instances"] == ["D", "P"]
    assert [e["rule"] for e in t.events if e["ev"] == "fault.inject"] == ["p-sends-full-allocation"]
    assert all(e.get("sim") for e in t.events if e["ev"] in ("nixl.read", "nixl.read_done", "nixl.send_done",
                                                             "fault.inject"))
    assert not any(e.get("sim") for e in t.events if e["ev"] in ("nixl.trim", "nixl.request_finished"))
    assert [e["id"] for e in t.events] == list(range(len(t.events)))


@pytest.mark.parametrize("prompt_len", [16, 29])
def test_dflash_lookahead_fault(pd_harness, pd_pair, prompt_len):
    cfg = pd_harness.PDConfig(spec_method="dflash", num_spec_tokens=3, block_size=16)
    k = 3
    clean = pd_harness.run_pd_request(cfg, prompt_len, pair=pd_pair(cfg))
    old_k = pd_harness.run_pd_request(cfg, prompt_len, pair=pd_pair(cfg), faults=["old_dflash_lookahead"])
    zero = pd_harness.run_pd_request(cfg, prompt_len, pair=pd_pair(cfg), faults=["old_dflash_lookahead"],
                                     dflash_variant="zero")

    def first_p_alloc(r):
        return [e for e in r.events if e["ev"] == "sched.alloc" and e["req"] == r.p_req][0]

    for r, la in ((clean, k + 1), (old_k, k), (zero, 0)):
        a = first_p_alloc(r)
        assert a["num_lookahead_tokens"] == la == a["sched_lookahead_tokens"]
        assert len(a["block_ids"][0]) == cdiv(prompt_len + la, 16)
    # the drafter writes k+1 positions past the prompt: only the clean run owns them all
    window_end = prompt_len + k + 1
    assert len(first_p_alloc(clean)["block_ids"][0]) * 16 >= window_end
    if prompt_len == 29:
        assert len(first_p_alloc(old_k)["block_ids"][0]) * 16 < window_end
    assert len(first_p_alloc(zero)["block_ids"][0]) * 16 < window_end
    # the fault is restored afterwards
    assert pd_pair(cfg).p.num_lookahead_tokens == k + 1


def test_ngram_has_no_lookahead(pd_harness, pd_pair):
    cfg = pd_harness.PDConfig(spec_method="ngram", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 16, pair=pd_pair(cfg))
    a = [e for e in r.events if e["ev"] == "sched.alloc" and e["req"] == r.p_req][0]
    assert a["num_lookahead_tokens"] == 0 and a["block_ids"] == r.p_reported == [r.p_allocated[0]]


def test_async_scheduling_run(pd_harness, pd_pair):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, async_scheduling=True)
    pair = pd_pair(cfg)
    assert type(pair.p).__name__ == "AsyncScheduler"
    r = pd_harness.run_pd_request(cfg, 32, pair=pair, faults=["old_p_block_rule"])
    assert len(r.p_reported[0]) == 3 and r.trim_remote == [r.p_allocated[0][1:3]]


def test_unknown_fault_rejected(pd_harness):
    with pytest.raises(ValueError, match="unknown fault"):
        pd_harness.run_pd_request(pd_harness.PDConfig(), 16, faults=["nope"])
