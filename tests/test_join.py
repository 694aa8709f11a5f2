"""The P/D join (pdtrace.detectors.transfers) and missing token counts, on hand-built events.
The real-vLLM cases (two P/D pairs in one process reusing request ids) are corpus scenarios."""

from __future__ import annotations

import json
import pathlib
import sys

from typer.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import eventlib as E  # noqa: E402

from pdtrace.cli import app  # noqa: E402
from pdtrace.detectors import LOOKAHEAD_MISALIGNMENT, run_all  # noqa: E402
from pdtrace.detectors.transfers import join_transfers  # noqa: E402


def _d_only(remote_num_tokens=None, n_ext=16, local=(50,), remote=(10, 11)):
    b = E.EventBuilder()
    b.config("D", lookahead=0)
    extra = {} if remote_num_tokens is None else {"remote_num_tokens": remote_num_tokens}
    b.add("nixl.remote_alloc", inst="D", req="d1", step=1, local_block_ids=[list(local)],
          remote_block_ids=[list(remote)], num_external_tokens=n_ext, remote_req="p1",
          remote_engine="P-engine", **extra)
    return b


def test_missing_remote_num_tokens_is_unknown_not_zero(tmp_path):
    b = _d_only()
    (t,) = join_transfers(b.events)
    assert t.remote_num_tokens is None and t.tokens_source == ""
    (f,) = [f for f in run_all(b.events) if f.kind == LOOKAHEAD_MISALIGNMENT]
    assert f.severity == "inconclusive" and "None" not in f.title + f.explanation
    assert "remote_num_tokens=0" not in f.title
    r = CliRunner().invoke(app, ["check", b.write(tmp_path / "t.jsonl"), "--format", "json"])
    doc = json.loads(r.output)
    assert r.exit_code == 4 and doc["summary"]["inconclusive"] == 1 and doc["summary"]["errors"] == 0


def test_token_count_falls_back_to_other_evidence():
    b = _d_only(local=(50, 51), remote=(10, 11), n_ext=32)  # every remote block loaded: no prefix hit
    (t,) = join_transfers(b.events)
    assert t.remote_num_tokens == 32 and "num_external_tokens" in t.tokens_source
    assert run_all(b.events) == []
    b = _d_only(remote_num_tokens=16)  # D's params said it: the extra block is P's lookahead block
    (f,) = run_all(b.events)
    assert f.severity == "error" and f.data["groups"][0]["extra_blocks"] == [11]


def test_p_engine_must_match_and_p_must_finish_first():
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, fixed=True, req="r1")
    p = next(e for e in b.events if e["ev"] == "nixl.request_finished")
    p["engine"] = "P0"  # eventlib's D names remote_engine "P0"
    (t,) = join_transfers(b.events)
    assert t.p_finished is p and t.d_alloc is not None
    p["engine"] = "another-P"  # same request id, another engine: not this D's source
    trs = join_transfers(b.events)
    assert [(x.p_finished is not None, x.d_alloc is not None) for x in trs] == [(True, False), (False, True)]
    p["engine"] = "P0"
    a = next(e for e in b.events if e["ev"] == "nixl.remote_alloc")
    a["id"], p["id"] = p["id"], a["id"]  # D allocated before P finished ...
    p["w"] = a["w"] + 1_000_000_000  # ... a second before: another round's report, not this transfer's
    trs = join_transfers(b.events)
    assert all(x.p_finished is None or x.d_alloc is None for x in trs)
    # 4 ms after D's allocation, while it is open: the two processes' clocks apart (a live CPU run on one host,
    # 2026-11-27, put 3 of 10 P reports so in the merged trace); it is the report D pulled
    p["w"] = a["w"] + 4_000_000
    (t,) = join_transfers(b.events)
    assert t.p_finished is p and t.d_alloc is a


def test_shift_text_never_says_none():
    b = E.lookahead_scenario(prompt_len=16, lookahead=1)
    rd = next(e for e in b.events if e["ev"] == "nixl.read")
    rd["remote_block_ids"] = [[999]]  # a block P never reported: its own mechanism (issue 59), no shift
    (f,) = [f for f in run_all(b.events) if f.kind == LOOKAHEAD_MISALIGNMENT]
    assert "None" not in f.title + f.explanation and "did not report" in f.title and "[999]" in f.title
    assert f.data["not_reported"] == [999] and "shift" not in f.title


def test_fresh_row_after_batch_growth_is_not_stale():
    from pdtrace.detectors import STALE_ACCEPTED_COUNT_READ

    b = E.stale_read_scenario(fixed=True)  # rows 0-2 copied at step 4
    b.add("batch.add", inst="D", req="r4", step=5, row=3)  # the batch grew after the copy
    b.add("acc.read", inst="D", req="r4", step=5, row=3, value=1, event="ev7", event_done=True)
    assert [f for f in run_all(b.events) if f.kind == STALE_ACCEPTED_COUNT_READ] == []
    # r4 reading a row the copy filled for r3 -> reported, naming the copy that wrote it
    b2 = E.stale_read_scenario(fixed=True)
    b2.add("batch.add", inst="D", req="r4", step=5, row=3)
    b2.add("acc.read", inst="D", req="r4", step=5, row=2, value=2, event="ev7", event_done=True)
    (f,) = [f for f in run_all(b2.events) if f.kind == STALE_ACCEPTED_COUNT_READ]
    assert f.req == "r4" and "row-moved" in f.data["reasons"] and f.data["held"][:2] == ["c", "r3"]


def test_a_push_mode_trim_on_p_maps_d_s_request():
    """Push mode: P's worker runs the trim (nixl.trim on inst P, req = P's request, remote_req =
    D's, mode "push", as hooks/nixl.py records it inside NixlPushConnectorWorker._xfer_blocks).
    The join pairs it with D's allocation of that request (mapping from the trim), not with a
    D-side request of the same id, and never leaves it unkeyed."""
    b = _d_only(remote_num_tokens=32, local=(50, 51), remote=(10, 11, 12), n_ext=32)
    b.add("nixl.trim", inst="P", req="p1", step=2, local_in=[[50, 51]], remote_in=[[10, 11, 12]],
          local_out=[[50, 51]], remote_out=[[11, 12]], mode="push", remote_req="d1")
    (t,) = join_transfers(b.events)
    assert t.mapping_source == "nixl.trim" and t.trim["mode"] == "push"
    assert t.mapping == [[(50, 11), (51, 12)]]
