"""pdtrace.testing.worker_sim: the documented worker-side simulation (seeds 002, 003, 004).

The simulation drives pdtrace's worker hooks: real InputBatch and NixlConnector code runs
on CPU (events without ``sim``); GPU-only runner/proposer steps are faithful minimal
callers with a fake CUDA event (events with ``sim: true``). These tests check the values
those events carry, computed independently from the event stream.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdtrace import schema  # noqa: E402
from pdtrace.record.recorder import Recorder  # noqa: E402
from pdtrace.testing import worker_sim as ws  # noqa: E402

SIM_KINDS = {"spec.phase", "d2h.issue", "d2h.done", "acc.read", "acc.truth", "spec.window"}
LIVE_KINDS = {"kvmeta.bind", "kvmeta.clear", "kvmeta.has", "kvmeta.save_layer", "kvmeta.wait_for_save",
              "batch.add", "batch.remove", "batch.swap", "batch.condense"}


def run(fn, *a, **kw):
    rec = Recorder.in_memory(role="worker", inst="P")
    out = fn(rec, *a, **kw)
    rec.flush()
    evs = [e for e in rec.events if e["ev"] in SIM_KINDS | LIVE_KINDS]
    for e in evs:
        assert schema.validate_event(e) is None, e
        assert e.get("sim") is (True if e["ev"] in SIM_KINDS else None), e
    assert rec.hook_errors == {}
    return out, evs


# ---------------------------------------------------------------------------------------
# seed 002
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fixed", "buggy"])
def test_connector_metadata_steps(mode):
    out, evs = run(ws.connector_metadata_steps, ["r1", "r2"], 2, mode,
                   target_layers=["t.0", "t.1"], drafter_layers=["d.0"], start_step=5)
    assert out["steps"] == [5, 6]
    per_step = {}
    for e in evs:
        per_step.setdefault(e["step"], []).append(e)
    assert sorted(per_step) == [5, 6]
    for step, seq in per_step.items():
        bind = [e for e in seq if e["ev"] == "kvmeta.bind"]
        assert [(b["reqs"], b["n_send"]) for b in bind] == [(["r1", "r2"], 2)]
        drafter_has = [e["result"] for e in seq if e["ev"] == "kvmeta.has" and e["phase"] == "drafter"]
        saves = [(e["phase"], e["layer"]) for e in seq if e["ev"] == "kvmeta.save_layer"]
        # where the clear happened relative to the drafter phase
        names = [(e["ev"], e.get("phase"), e.get("edge")) for e in seq]
        clear_i = names.index(("kvmeta.clear", "", None))
        drafter_begin_i = names.index(("spec.phase", "drafter", "begin"))
        if mode == "fixed":
            assert drafter_has == [True]
            assert saves == [("target", "t.0"), ("target", "t.1"), ("drafter", "d.0")]
            assert clear_i > drafter_begin_i
        else:
            assert drafter_has == [False]
            assert saves == [("target", "t.0"), ("target", "t.1")]
            assert clear_i < drafter_begin_i
    want = {"fixed": {"target": 4, "drafter": 2}, "buggy": {"target": 4, "drafter": 0}}[mode]
    assert out["saved"] == want


# ---------------------------------------------------------------------------------------
# seed 004
# ---------------------------------------------------------------------------------------

def _check_reads(evs):
    """Replay the event stream: for each acc.read, the truth (acc.truth for step-1 of the
    same request) and the request that held the read row at the last d2h.issue."""
    truths = {(e["req"], e["for_step"]): e["value"] for e in evs if e["ev"] == "acc.truth"}
    last_issue = None
    rows = []
    for e in evs:
        if e["ev"] == "d2h.issue":
            last_issue = e
        elif e["ev"] == "acc.read" and last_issue is not None:
            rows.append({
                "req": e["req"], "row": e["row"], "value": e["value"], "step": e["step"],
                "truth": truths.get((e["req"], e["step"] - 1)),
                "issued_to": last_issue["rows"][e["row"]] if e["row"] < len(last_issue["rows"]) else "",
                "event_done": e["event_done"], "synced": e["synced"], "event": e["event"],
                "issue_event": last_issue["event"],
            })
    return rows


@pytest.mark.parametrize("moves", [True, False])
@pytest.mark.parametrize("mode", ["fixed", "buggy"])
def test_accepted_counts_steps(mode, moves):
    out, evs = run(ws.accepted_counts_steps, ["a", "b", "c", "d"], 6, mode, row_moves=moves, k=3)
    reads = _check_reads(evs)
    assert reads and all(r["truth"] is not None for r in reads)
    assert all(r["event"] == r["issue_event"] and r["event_done"] is False for r in reads)
    kinds = {e["ev"] for e in evs}
    assert {"d2h.issue", "d2h.done", "acc.read", "acc.truth"} <= kinds
    moved_reads = [r for r in reads if r["issued_to"] != r["req"]]
    # requests sitting in another row than when the copy was issued (sim summary: current rows)
    now_rows = {(r["step"], r["req"]): r["row"] for r in out["reads"]}
    moved_since_issue = [r for r in reads if r["req"] != r["issued_to"]
                         or now_rows[(r["step"], r["req"])] != r["row"]]
    if moves:
        assert {"batch.swap", "batch.condense", "batch.remove"} <= kinds
        assert out["finished"] == ["d"] and moved_since_issue
    else:
        assert not ({"batch.swap", "batch.condense"} & kinds) and not moved_since_issue
    if mode == "fixed":
        assert not moved_reads  # the runner reads each request's issue-time row
        assert all(r["synced"] for r in reads)
        assert all(r["value"] == r["truth"] for r in reads)  # including reads after row moves
        assert out["mismatches"] == []
    else:
        assert not any(r["synced"] for r in reads)
        bad = [r for r in reads if r["value"] != r["truth"]]
        assert bad and len(out["mismatches"]) == len(bad)
        if moves:
            # some request read a row that held another request when the copy was issued
            assert moved_reads
            assert any(r["value"] != r["truth"] and r["issued_to"] != r["req"] for r in bad)
    # the sim's own summary agrees with the event stream
    assert [(r["step"], r["req"], r["value"]) for r in out["reads"] if r["truth"] is not None] == \
        [(r["step"], r["req"], r["value"]) for r in reads]


# ---------------------------------------------------------------------------------------
# seed 003
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,n", [("dflash", 4), ("eagle", 3)])
@pytest.mark.parametrize("mode", ["fixed", "buggy"])
def test_drafter_window(method, n, mode):
    out, evs = run(ws.drafter_window, ["x", "y"], [32, 20], mode, method=method, k=3, step=3,
                   block_ids={"x": [7, 8], "y": [1, 2]}, block_size=16)
    wins = [(e["req"], e["start"], e["end"], e["method"], e["step"]) for e in evs if e["ev"] == "spec.window"]
    assert wins == [("x", 32, 32 + n, method, 3), ("y", 20, 20 + n, method, 3)]
    assert [(o["req"], o["start"], o["end"]) for o in out] == [("x", 32, 32 + n), ("y", 20, 20 + n)]
    # x's prompt fills its 2 blocks exactly: every drafter position is past the allocation
    assert out[0]["overflow_positions"] == list(range(32, 32 + n))
    assert out[1]["overflow_positions"] == []


def test_mode_is_checked():
    with pytest.raises(ValueError):
        ws.drafter_window(Recorder.in_memory(), ["x"], [4], "broken")
