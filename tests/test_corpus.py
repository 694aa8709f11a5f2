"""The labelled detector corpus, built on real vLLM 0.32.0 code on CPU.

Each scenario (pdtrace/testing/scenarios.py) runs the real Scheduler / KVCacheManager /
NIXL connector (P and D) and the real _apply_prefix_caching with pdtrace's hooks, plus the
documented worker-side simulation where the code needs a GPU; faults re-introduce the
pre-fix upstream rules. Labels come from the injected fault and the real block lists (an
oracle independent of the detectors). Covers block-aligned and non-aligned prompts, 0/1/2
trailing lookahead blocks, a hybrid model with a Mamba state group, sliding-window-only and
sliding + full attention, chunked local attention, reused request ids across two P/D pairs,
failed hooks, DFlash, and async scheduling with and without row moves and with batch growth. docs/corpus.md is the
table of it (checked here against the runs).
"""

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from pdtrace import detectors  # noqa: E402
from pdtrace.detectors.base import ALL_KINDS  # noqa: E402
from pdtrace.detectors.coverage import NOT_CHECKED, coverage  # noqa: E402
from pdtrace.testing import scenarios  # noqa: E402


@pytest.fixture(scope="module")
def corpus():
    out = {}
    for name in scenarios.SCENARIOS:
        sc = scenarios.build(name)
        for i, e in enumerate(sc.events):
            e["id"] = i
        out[name] = (sc, detectors.run_all(sc.events, {}))
    return out


def test_precision_and_recall_are_one(corpus):
    tp = fp = fn = 0
    for name, (sc, findings) in corpus.items():
        found = {f.kind for f in findings}
        exp = set(sc.expected)
        tp += len(found & exp)
        fp += len(found - exp)
        fn += len(exp - found)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    assert (precision, recall) == (1.0, 1.0), {n: (sc.expected, sorted({f.kind for f in f_}))
                                               for n, (sc, f_) in corpus.items()}
    assert tp >= 8  # every class has buggy scenarios in the corpus
    assert {k for sc, _ in corpus.values() for k in sc.expected} == set(ALL_KINDS)


def test_misalignment_points_at_the_shifted_block(corpus):
    sc, findings = corpus["lookahead_aligned16_k1_buggy"]
    (f,) = [f for f in findings if f.kind == "lookahead-block-misalignment"]
    facts = sc.provenance["facts"]
    p_alloc = facts["p_allocated"][0]  # [real prompt block, lookahead block]
    assert len(p_alloc) == 2 and facts["p_reported"][0] == p_alloc  # the old rule reported both
    assert facts["trim_remote"][0] == [p_alloc[1]]  # D's only block filled from P's lookahead block
    assert f.severity == "error"
    assert str(p_alloc[1]) in f.explanation and str(p_alloc[0]) in f.explanation


def test_two_trailing_blocks_and_hybrid(corpus):
    sc, _ = corpus["lookahead_aligned32_k17_buggy"]
    assert sc.provenance["facts"]["trailing_lookahead_blocks"] == 2
    sc, findings = corpus["lookahead_hybrid_mamba_buggy"]
    assert findings and {f.kind for f in findings} == {"lookahead-block-misalignment", "kv-invariant"}
    for f in findings:  # only the attention group is flagged; the Mamba state group is never clipped / judged
        assert "Mamba" not in f.title and "Mamba" not in str(f.data.get("group_kind", ""))
    sc, findings = corpus["lookahead_unaligned20_k3_buggy"]
    assert sc.provenance["facts"]["trailing_lookahead_blocks"] == 0 and not findings


def test_coverage_matches_what_each_scenario_recorded(corpus):
    """`check`'s per-class coverage against the builders' own account of what they recorded
    (worker simulations added, hooks made to fail, hybrid or not)."""
    for name, (sc, _findings) in corpus.items():
        cov = coverage(sc.events)
        assert sorted(k for k, c in cov.items() if c.status == NOT_CHECKED) == sc.not_checked, \
            (name, {k: c.line() for k, c in cov.items()})


def test_failed_hooks_are_never_clean(corpus):
    sc, findings = corpus["hook_failure_scheduler_fixed"]
    errs = [e for e in sc.events if e["ev"] == "hook.error"]
    assert {e["hook"] for e in errs} >= {"scheduler.init", "scheduler.schedule", "scheduler.allocate_slots"}
    # (sched.output is the kv_load hook's, on update_from_output, which did not fail)
    assert not [e for e in sc.events if e["ev"].startswith(("sched.", "req.")) and e["ev"] != "sched.output"]
    assert findings == []
    cov = coverage(sc.events)
    assert all(c.status == NOT_CHECKED for c in cov.values())
    assert "hook scheduler.init raised" in cov["lookahead-block-misalignment"].reason
    # the buggy run whose NIXL hooks failed: the real defect is not visible, and the class says so
    sc, findings = corpus["hook_failure_nixl_buggy"]
    reported, filled = sc.provenance["facts"]["p_reported"][0], sc.provenance["facts"]["trim_remote"][0]
    assert len(reported) == 2 and filled == reported[1:]  # D's block really got P's lookahead block
    # the rule, blind without P's report, says nothing; the invariant still sees D read P's never-written block
    # from the nixl.read the worker recorded, and its class is "not checked" all the same (a hook of it failed)
    assert [(f.kind, f.data["mechanism"]) for f in findings] == [("kv-invariant", "p-unwritten")]
    cov = coverage(sc.events)
    c = cov["lookahead-block-misalignment"]
    assert c.status == NOT_CHECKED and "hook nixl.request_finished raised" in c.reason
    assert cov["kv-invariant"].status == NOT_CHECKED


def test_fixed_runs_are_clean(corpus):
    for name, (sc, findings) in corpus.items():
        if name.endswith("_fixed"):
            assert findings == [], name


def test_reused_ids_do_not_cross_join(corpus):
    """Two P/D pairs in one process, both with request id 'id-1': each D allocation is joined
    with its own P (engine id, trace order), and block sizes come from that pair's config."""
    from pdtrace.detectors.transfers import join_transfers

    sc, findings = corpus["reused_ids_two_pairs_buggy"]
    trs = [t for t in join_transfers(sc.events) if t.d_alloc is not None]
    assert len(trs) == 2
    for t in trs:
        assert t.p_finished["engine"] == t.d_alloc["remote_engine"] == t.config["engine"]
        assert t.config["pid"] == t.p_finished["pid"] and t.config["sched"] == t.p_finished["sched"]
    assert sorted(t.config["block_sizes"][0] for t in trs) == [16, 32]
    (f,) = findings  # (the KV invariant: not checked here, two schedulers per instance in one process)
    facts = sc.provenance["facts"]["pair1"]
    assert f.severity == "error" and f.data["groups"][0]["block_size"] == 16
    assert f.data["groups"][0]["reported"] == facts["p_reported"][0]
    cfg = [e for e in sc.events if e["ev"] == "sched.config" and e["id"] in f.event_ids]
    assert [c["block_sizes"] for c in cfg] == [[16]] and cfg[0]["kv_role"] == "kv_producer"
    sc, findings = corpus["reused_ids_two_pairs_fixed"]
    assert findings == []


def test_fresh_rows_after_batch_growth_are_not_stale(corpus):
    """Issue 19 point 4 as a corpus shape: two requests join the real InputBatch at step 4 in
    rows past the ones step 3's accepted-count copy wrote. No finding cites them, on the
    synchronized path (where they read nothing) and on the racy one (where they read rows the
    copy did not cover, holding add_request's value) while the covered rows' racy reads are
    still flagged."""
    for name in ("stale_read_batch_growth_fixed", "stale_read_batch_growth_buggy"):
        sc, findings = corpus[name]
        grown = sc.provenance["facts"]["grown"]
        assert [g["req"] for g in grown] == ["grow-a", "grow-b"], name
        issue = [e for e in sc.events if e["ev"] == "d2h.issue" and e["step"] == 3][-1]
        fresh_reads = [e for e in sc.events if e["ev"] == "acc.read" and e["step"] == 4
                       and e["req"] in ("grow-a", "grow-b")]
        if name.endswith("_fixed"):
            # 0.32.0's synchronized path maps rows through prev_req_id_to_index: a request with
            # no previous row gets the constant 1 and reads nothing (no acc.read)
            assert fresh_reads == [], name
        else:  # the racy path reads the current rows: past the copy's rows, add_request's 1
            assert len(fresh_reads) == 2 and all(e["row"] >= len(issue["rows"]) for e in fresh_reads), name
            assert {e["value"] for e in fresh_reads} == {1}, name
        later = [e for e in sc.events if e["ev"] == "acc.read" and e["step"] == 5 and e["req"].startswith("grow-")]
        assert len(later) == 2, name  # the next step's copy covers them
        # step 4: the fresh rows' reads; from step 5 on they are covered rows like the others
        cited = {f.req for f in findings if f.step == 4}
        assert not cited & {"grow-a", "grow-b"}, (name, [f.title for f in findings])
        if name.endswith("_buggy"):
            assert findings and {f.kind for f in findings} == {"stale-accepted-count-read"}


def corpus_table(corpus) -> str:
    """docs/corpus.md: one row per scenario, expected vs found, and the totals."""
    rows = ["# The labelled detector corpus", "",
            "Generated from `tests/test_corpus.py` (`corpus_table`; the test fails when this file and the runs "
            "disagree). Each scenario runs real vLLM scheduler / KV cache manager / NIXL connector code on CPU "
            "(pdtrace/testing/scenarios.py); `buggy` ones re-introduce a pre-fix upstream rule.", "",
            "| scenario | what | expected | found |", "| --- | --- | --- | --- |"]
    tp = fp = fn = 0
    for name, (sc, findings) in corpus.items():
        found, exp = sorted({f.kind for f in findings}), sorted(set(sc.expected))
        tp += len(set(found) & set(exp))
        fp += len(set(found) - set(exp))
        fn += len(set(exp) - set(found))
        desc = scenarios.SCENARIOS[name][0].replace("|", "/")
        rows.append(f"| `{name}` | {desc} | {', '.join(exp) or 'none'} | {', '.join(found) or 'none'} |")
    rows += ["", f"{len(corpus)} scenarios; true positives {tp}, false positives {fp}, false negatives {fn}: "
             f"precision {tp / (tp + fp) if tp + fp else 1.0:.2f}, recall {tp / (tp + fn) if tp + fn else 1.0:.2f}.", ""]
    return "\n".join(rows)


def test_docs_corpus_table_is_current(corpus):
    doc = Path(__file__).parent.parent / "docs" / "corpus.md"
    want = corpus_table(corpus)
    if not doc.exists() or doc.read_text() != want:
        import os
        if os.environ.get("PDTRACE_UPDATE_DOCS") == "1":
            doc.write_text(want)
        assert doc.read_text() == want, "docs/corpus.md is stale: PDTRACE_UPDATE_DOCS=1 pytest tests/test_corpus.py"


def test_2p2d_findings_name_exactly_the_shifted_transfers(corpus):
    """Four transfers between two prefill and two decode engines of equal config: the join
    pairs each D allocation with its own P by engine id, so only P2's two requests are cited."""
    sc, findings = corpus["two_p_two_d_buggy"]
    facts = sc.provenance["facts"]
    assert facts["shifted"] == ["P2->D1", "P2->D2"]
    assert sorted({f.req for f in findings}) == facts["p_requests_shifted"]
    assert coverage(sc.events)["kv-invariant"].status == NOT_CHECKED and "two schedulers of one instance" in \
        coverage(sc.events)["kv-invariant"].reason
    assert corpus["two_p_two_d_fixed"][1] == []


def test_streamed_check_gives_the_same_findings_on_every_scenario(corpus, tmp_path):
    """`check` reads a trace in segments (pdtrace.detectors.stream, issue 22): on every
    scenario, written as a trace and streamed in segments of 1, 4 and 1000 events, the
    findings and coverage are those of the whole event list, and so is the --what-if replay."""
    from pdtrace.detectors import whatif
    from pdtrace.detectors import stream
    from pdtrace.detectors.coverage import coverage_of
    from pdtrace.tracefile.trace import load, make_header, write_trace

    replayed = 0

    for name, (sc, findings) in corpus.items():
        p = tmp_path / f"{name}.jsonl"
        write_trace(str(p), make_header(origin="synthetic", versions={}), sc.events)
        want = [f.to_dict() for f in findings]
        want_cov = {k: c.to_dict() for k, c in coverage(sc.events).items()}
        want_wi = whatif.fixed_trim(load(str(p)).events)
        replayed += bool(want_wi)
        for size in (1, 4, 1000):
            res = stream.run(str(p), size=size, observe=whatif.FixedTrim)
            assert [f.to_dict() for f in res.findings] == want, (name, size)
            assert {k: c.to_dict() for k, c in coverage_of(res.summary, notes=res.notes).items()} == want_cov, \
                (name, size)
            assert res.observed.finish() == want_wi, (name, size)  # check --what-if fixed-trim, streamed
    assert replayed >= 5
