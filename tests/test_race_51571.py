"""vLLM #51571 (open): the accepted-count copy lands before InputBatch row moves, and the gather
through ``prev_positions`` reads the moved rows.

Real parts: vLLM's InputBatch and its reorder function (pdtrace.testing.race_sim; whichever vLLM
the suite runs on, 0.32.0 or 0.33.0). Simulated (GPU-only): the copy, its CUDA event, and the
read branch of ``_prepare_inputs`` as 0.32.0 / 0.33.0 write it. The oracle is the real buffer:
the value each decode read against its own count, not the detector.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdtrace.detectors import STALE_ACCEPTED_COUNT_READ
from pdtrace.detectors.stale_read import detect

pytest.importorskip("vllm")

EVIDENCE = Path(__file__).resolve().parents[2] / "shared" / "evidence" / "live_h200_hybrid_async_align_v1.jsonl.zst"


def _run(order, fix):
    from pdtrace.testing import pd_harness as pd
    from pdtrace.testing import race_sim

    rec = pd.new_recorder()
    rec.set_role(role="worker", inst="D", why="race_sim")
    res = race_sim.run(rec, order, fix)
    rec.flush()
    events = [dict(e, id=i) for i, e in enumerate(rec.events)]
    return res, [f for f in detect(events) if f.kind == STALE_ACCEPTED_COUNT_READ], events


@pytest.mark.parametrize("fix", [False, True], ids=["vllm-as-released", "pr51599-approach-LABELLED"])
@pytest.mark.parametrize("order", ["before", "after", "during"])
def test_where_the_copy_lands_decides_the_read(order, fix):
    """Rows [A, B, C] hold [1, 3, 4]; B finishes, N takes its row, the real reorder swaps C
    before N. As released: landed before the moves, C reads N's 1 (flagged, naming the swap);
    after them, C reads 4 (clean); during the swap, the trace cannot order them (inconclusive,
    never clean). With the snapshot of PR #51599 (labelled): no wrong read, no finding."""
    res, found, events = _run(order, fix)
    assert res["rows"] == ["A", "C", "N"]
    errors = sorted(f.req for f in found if f.severity == "error")
    assert errors == res["wrong"]  # exactly the reads the real buffer got wrong
    if fix or order == "after":
        assert res["wrong"] == [] and found == []
    elif order == "before":
        (f,) = found
        swap = next(e for e in events if e["ev"] == "batch.swap")
        assert (f.req, f.severity, f.data["value"], f.data["own"], f.data["moved_by"]) == ("C", "error", 1, 4, swap["id"])
        assert f.data["held"][:2] == ["a", "N"] and "#51571" in f.explanation and "swap_states" in f.explanation
        assert f.data["row_held"] == "the 1 that add_request wrote for N"  # (JSON's held, in words: issue 49)
    else:
        assert res["wrong"] == [] and [(f.req, f.severity) for f in found] == [("C", "inconclusive")]
        assert any(e.get("landed") == "unknown" for e in events if e["ev"] == "batch.swap")


def test_hooks_record_the_landing_and_the_copy_destination():
    """What decides it is recorded without a sync: each move while the copy is in flight says
    where it landed; d2h.done carries the copy's own values; the #51599 snapshot is named."""
    _res, _f, ev = _run("after", False)
    moves = [e for e in ev if e["ev"] in ("batch.add", "batch.swap") and e.get("step") == 2]
    assert [e.get("landed") for e in moves] == ["after", "after"]
    (issue,) = [e for e in ev if e["ev"] == "d2h.issue"]
    assert issue["moves_with_rows"] is True
    _res, _f, ev = _run("before", False)
    (done,) = [e for e in ev if e["ev"] == "d2h.done"]
    assert done["values"] == [1, 3, 4]
    _res, _f, ev = _run("before", True)
    (issue,) = [e for e in ev if e["ev"] == "d2h.issue"]
    assert issue["moves_with_rows"] is False
    assert all("landed" not in e for e in ev if e["ev"].startswith("batch."))


def test_live_h200_evidence_reads_that_disagree_are_findings():
    """../shared/evidence (vLLM 0.32.0 on an H200, V1 runner, align mode, async, ngram_gpu): of
    the reads that disagree with their request's acc.truth, those the align postprocess explains
    (its kernel writes 1 when the accepted tokens cross a block boundary: mamba_utils.py
    postprocess_mamba_fused_kernel, ``src_block_idx == dest_block_idx``) are not findings, and
    every other one is an error. Oracle: each request's own prompt length and accepted counts
    (block size 48 from sched.config), not the detector."""
    if not EVIDENCE.exists():
        pytest.fail(f"{EVIDENCE} is missing (CI lays ../shared beside the clone)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import race_oracle  # the rule below, written once: scripts/race_oracle.py's acc.truth + align oracle

    events = race_oracle.events(str(EVIDENCE))
    o = race_oracle.oracle(events)
    assert o["block_size"] == 48 and not o["judged"]  # no copy values in this older recording
    disagree, align_reset = o["disagree"], o["align_reset"]
    assert len(disagree) == 42
    found = [f for f in detect(events) if f.kind == STALE_ACCEPTED_COUNT_READ]
    errors = {(f.req, f.step) for f in found if f.severity == "error"}
    # every disagreeing read is an error or an align reset; an error read a row another request's
    # value sat in (the few that are both crossed a boundary AND read another row: with no d2h
    # values in this older recording, their own count, 1 or the truth, is not known)
    assert errors <= disagree
    assert errors | align_reset == disagree, sorted(disagree - errors - align_reset)
    assert all(f.data["reasons"] == ["row-moved"] and f.data["held"][1] != f.req for f in found if f.severity == "error")
    assert len(errors) == 14 and len(disagree - errors) == 28
    assert all("#51571" in f.explanation for f in found if f.severity == "error")
    assert not [f for f in found if f.severity == "inconclusive"]


def test_a_read_without_query_result_is_not_a_race():
    """event_done None (an event without query(), as vLLM's CPU worker has) and no sync: taken
    as landed, as the detector always did; only a query() that said False is a race."""
    evs = [{"ev": "batch.add", "pid": 1, "inst": "D", "req": "a", "row": 0},
           {"ev": "d2h.issue", "pid": 1, "inst": "D", "rows": ["a"], "event": "e1"},
           {"ev": "acc.read", "pid": 1, "inst": "D", "step": 2, "req": "a", "row": 0, "value": 2,
            "event": "e1", "event_done": None, "synced": False}]
    evs = [dict(e, id=i) for i, e in enumerate(evs)]
    assert detect(evs) == []
    evs[-1]["event_done"] = False
    (f,) = detect(evs)
    assert f.data["reasons"] == ["copy-not-complete"]


def _old_recording(synced: bool, value: int) -> list[dict]:
    """A recording by the hooks before the moves' ``landed`` field: rows [a, b] copied, a
    finishes, the condense moves b to row 0 with the copy in flight, b reads row 0. b's
    authoritative count (acc.truth of the step the copy was for) is 4."""
    evs = [{"ev": "batch.add", "pid": 1, "inst": "D", "step": 1, "req": "a", "row": 0},
           {"ev": "batch.add", "pid": 1, "inst": "D", "step": 1, "req": "b", "row": 1},
           {"ev": "d2h.issue", "pid": 1, "inst": "D", "step": 1, "rows": ["a", "b"], "event": "e1",
            "moves_with_rows": True},
           {"ev": "batch.remove", "pid": 1, "inst": "D", "step": 2, "req": "a", "row": 0},
           {"ev": "batch.condense", "pid": 1, "inst": "D", "step": 2, "moves": [["b", 1, 0]]},
           {"ev": "acc.truth", "pid": 1, "inst": "D", "step": 1, "req": "b", "value": 4, "for_step": 1},
           {"ev": "acc.read", "pid": 1, "inst": "D", "step": 2, "req": "b", "row": 0, "value": value,
            "event": "e1", "event_done": True, "synced": synced, "mapping": "direct"}]
    return [dict(e, id=i) for i, e in enumerate(evs)]


@pytest.mark.parametrize("synced, value, severity", [(False, 1, "error"), (False, 4, "inconclusive"),
                                                     (True, 1, "inconclusive")])
def test_an_unsynchronized_read_that_differs_from_the_truth_is_wrong_whatever_the_landing(synced, value, severity):
    """Issue 50 item 4: where the trace cannot say when the copy landed, an unsynchronized read
    of a value other than the authoritative count is an error (the copy carries that count on
    this path); the same read of the right value, or a synchronized read (Mamba align mode copies
    1 by design), stays inconclusive. The oracle is acc.truth, the GPU-side count."""
    (f,) = detect(_old_recording(synced, value))
    assert (f.req, f.severity) == ("b", severity)
    if severity == "error":
        assert f.data["reasons"] == ["landing-unknown", "value-wrong"] and f.data["truth"] == 4
        assert "read 1, authoritative value 4" in f.title and "not in the trace" in f.title
        from pdtrace.detectors.causes import mechanism
        assert mechanism(f)[0] == "stale-read/wrong-landing-unknown"


def test_a_damaged_condense_makes_the_rows_unknown_not_a_crash():
    """A condense record whose moves are not [req, old, new] (a damaged trace read with
    --lenient passes the schema's list[list]): the rows it touched are unknown, so a read of
    them is inconclusive, never clean and never a crash."""
    evs = [{"ev": "batch.add", "pid": 1, "inst": "D", "req": r, "row": i} for i, r in enumerate("abc")]
    evs += [{"ev": "d2h.issue", "pid": 1, "inst": "D", "rows": ["a", "b", "c"], "event": "e1"},
            {"ev": "d2h.done", "pid": 1, "inst": "D", "event": "e1"},
            {"ev": "batch.remove", "pid": 1, "inst": "D", "req": "b", "row": 1},
            {"ev": "batch.condense", "pid": 1, "inst": "D", "moves": [[1]]},
            {"ev": "acc.read", "pid": 1, "inst": "D", "step": 2, "req": "c", "row": 2, "value": 4,
             "event": "e1", "event_done": True, "synced": True}]
    (f,) = detect([dict(e, id=i) for i, e in enumerate(evs)])
    assert (f.req, f.severity) == ("c", "inconclusive")


@pytest.mark.parametrize("order", ["before", "after"])
def test_the_viewer_acc_pane_gives_the_detector_verdict(tmp_path, order):
    """The Accepted counts pane (viewers/tui/model_acc.py) on the recorded race, once the
    detectors have run: C's read through its previous row is wrong when the copy landed before
    the swap and right when it landed after; the pane's first look (rows at copy time, owner
    now) would call both wrong, since C moved."""
    from pdtrace.commands.view import open_source
    from pdtrace.tracefile.writer import write_trace
    from pdtrace.viewers.tui import model

    res, found, events = _run(order, False)
    path = tmp_path / f"race-{order}.jsonl"
    write_trace(str(path), {"ev": "trace.header", "schema": "pdtrace", "schema_version": 2, "origin": "scenario"},
                [{k: v for k, v in e.items() if k != "id"} for e in events])
    idx = open_source(path)
    idx.build()
    try:
        (view,) = model.accepted(idx, 2, findings=found)
        c = next(r for r in view.rows if r.req == "C")
        assert (c.status == "ok") == (order == "after") == ("C" not in res["wrong"])
        if order == "before":
            assert c.status == "wrong-row,wrong-value" and c.finding is found[0]
        (first_look,) = model.accepted(idx, 2)
        assert "wrong-row" in next(r for r in first_look.rows if r.req == "C").status
    finally:
        idx.close()
