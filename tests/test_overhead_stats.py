"""bench/overhead_stats.py: the arithmetic behind bench/live_overhead_gpu.py's verdict (issue 38), on hand-made
loads whose answer is known. The GPU figures themselves live in docs/live-gpu.md (benchmarks print ratios; no
timed test here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import overhead_stats as S  # noqa: E402


def _load(side, kind, phase, tok_s, rnd=0, cpu=0.005):
    return {"side": side, "kind": kind, "phase": phase, "round": rnd, "tok_s": tok_s, "cpu_s_per_tok": cpu,
            "lat_per_tok": [1 / tok_s] * 4}


def _swap(a0, a1, b0, b1, c0, c1):
    """Two rounds per phase; A plain then rec, B rec then plain, C plain twice."""
    loads = []
    for ph, (a, b, c) in enumerate(((a0, b0, c0), (a1, b1, c1))):
        for r in range(2):
            loads += [_load("m-A", "plain" if ph == 0 else "rec", ph, a, r), _load("m-B", "rec" if ph == 0 else "plain", ph, b, r),
                      _load("m-C", "plain", ph, c, r)]
    return loads


SLOTS = {"A": "m-A", "B": "m-B", "C": "m-C"}


def test_swap_cancels_the_pairs_own_speed_and_the_drift_between_phases():
    # pair speeds 200 / 260 / 230, recording costs 2 %, phase 1 is 5 % faster for everyone (drift)
    d = 1.05
    loads = _swap(200, 200 * 0.98 * d, 260 * 0.98, 260 * d, 230, 230 * d)
    r = S.swap_ratios(loads, "tok_s", SLOTS)
    assert abs(r["estimate"]["median"] - 0.98) < 1e-3
    assert r["control"]["median"] == 1.05
    verdict, spread = S.verdict(r)
    assert verdict == "unresolved" and abs(spread - 0.05) < 1e-9  # the drift shows in the control: not judged


def test_swap_verdict_met_and_missed_when_the_control_is_tight():
    r = S.swap_ratios(_swap(200, 196, 255, 260, 230, 231), "tok_s", SLOTS)
    assert S.verdict(r)[0] == "met"
    r = S.swap_ratios(_swap(200, 180, 234, 260, 230, 231), "tok_s", SLOTS)
    assert r["estimate"]["median"] < 0.97 and S.verdict(r)[0] == "missed"


def test_a_tight_control_beside_a_swinging_recorded_pair_decides_nothing():
    """The 2-core dry run of 2026-11-27: C within 2 %, A's recorded rounds 0.68 and 1.25 of its plain."""
    loads = _swap(200, 196, 255, 260, 230, 231)
    for x in loads:
        if x["side"] == "m-A" and x["phase"] == 1:
            x["tok_s"] = 136 if x["round"] == 0 else 250
    r = S.swap_ratios(loads, "tok_s", SLOTS)
    assert abs(r["control"]["median"] - 1) < 0.01
    verdict, noise = S.verdict(r)
    assert verdict == "unresolved" and noise > 0.25


def test_pairs_design_uses_the_round_mean_of_the_plain_sides_and_their_ratio_as_control():
    loads = [_load("p-a", "plain", 0, 200, 0), _load("p-b", "plain", 0, 266, 0), _load("p-rec", "rec", 0, 248, 0)]
    r = S.pair_ratios(loads, "tok_s", ["p-a", "p-b"], ["p-rec"])
    assert r["p-rec"]["median"] == round(248 / 233, 4) and r["control"]["median"] == 1.33
    assert S.verdict(r)[0] == "unresolved"  # the 2026-11-27 H200 case: pairs 33 % apart decide nothing
    assert S.verdict(S.pair_ratios(loads, "tok_s", ["p-a"], ["p-rec"]))[0] == "unresolved"  # no control at all


def test_side_stats_and_table():
    loads = _swap(200, 196, 255, 260, 230, 231)
    st = S.side_stats(loads, "m-A", "rec")
    assert st["loads"] == 2 and st["tok_s_median"] == 196.0 and st["lat_per_tok_ms_median"] == round(1e3 / 196, 3)
    assert S.side_stats(loads, "m-A", "ring60") == {}
    ratios = S.swap_ratios(loads, "tok_s", SLOTS)
    v, spread = S.verdict(ratios)
    res = {"device": "H200", "runner": "v2", "design": "swap", "rounds_done": 4, "max_num_seqs": 8,
           "models": {"m": {"tok_s": ratios, "control_spread": spread, "verdict": v,
                            "sides": [S.side_stats(loads, s, k) for s in ("m-A", "m-B", "m-C") for k in ("plain", "rec")
                                      if S.side_stats(loads, s, k)]}}}
    text = S.table(res)
    assert "| m | A and B | geometric mean |" in text and "met" in text and "0.4 %" in text
