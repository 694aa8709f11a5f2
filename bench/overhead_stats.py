"""The arithmetic of bench/live_overhead_gpu.py, apart from the servers (so tests can hold it to hand-made loads).

A load is a dict: side (the pair's name), kind (plain | rec | ringN), phase (0, 1, ...), tok_s, cpu_s_per_tok,
lat_per_tok (seconds per output token of each request).

Two designs:
  * pairs: different pairs, each in one state for the whole run; per round a recorded side over the mean of that
    round's plain sides; two plain sides give the A/A control. Measured 2026-11-27 on an H200: two plain pairs
    differed by ~27 % persistently, so this design cannot resolve 3 % there (docs/live-gpu.md).
  * swap: the same pairs in two phases, restarted between them: slot A plain then recorded, slot B recorded then
    plain, slot C plain in both (the control). A pair's own speed cancels in A's and B's ratios (recorded / plain of
    the same pair, same cores); a drift between the phases multiplies A's ratio and divides B's, so their geometric
    mean cancels it; C's phase-1 rounds over its phase-0 median show what a restart and the drift alone give.
The verdict (recorded / plain >= GOAL) is given only when the noise (the control's farthest ratio from 1, and each
recorded side's round-to-round half-range) is below RESOLVE.
"""

from __future__ import annotations

import math
import statistics

GOAL = 0.97
RESOLVE = 0.03


def _summary(v: list[float]) -> dict:
    return {"ratios": [round(x, 4) for x in v], "median": round(statistics.median(v), 4),
            "min": round(min(v), 4), "max": round(max(v), 4)}


def pair_ratios(loads: list[dict], key: str, plains: list[str], recs: list[str]) -> dict:
    """pairs design: per round (loads grouped by their 'round'), each recorded side over the mean of the plain
    sides, and the second plain side over the first ('control')."""
    rounds: dict[int, dict] = {}
    for x in loads:
        rounds.setdefault(x["round"], {})[x["side"]] = x[key]
    out: dict[str, list[float]] = {}
    for by in rounds.values():
        if not plains or not all(by.get(p) for p in plains):
            continue
        ref = statistics.mean(by[p] for p in plains)
        for s in recs:
            if by.get(s):
                out.setdefault(s, []).append(by[s] / ref)
        if len(plains) >= 2:
            out.setdefault("control", []).append(by[plains[1]] / by[plains[0]])
    return {k: _summary(v) for k, v in out.items()}


def _vals(loads: list[dict], side: str, phase: int, key: str) -> list[float]:
    return [x[key] for x in loads if x["side"] == side and x["phase"] == phase and x[key]]


def swap_ratios(loads: list[dict], key: str, slots: dict[str, str]) -> dict:
    """swap design; ``slots``: role (A | B | C) -> side name. A: recorded (phase 1) / plain (phase 0) per
    phase-1 round; B: recorded (phase 0) / plain (phase 1) per phase-0 round; control: C's phase-1 rounds over
    its phase-0 median; 'estimate': the geometric mean of A's and B's medians (the phases' drift cancels)."""
    out: dict[str, dict] = {}
    for role, rec_ph, plain_ph in (("A", 1, 0), ("B", 0, 1), ("C", 1, 0)):
        side = slots.get(role)
        num, den = _vals(loads, side, rec_ph, key), _vals(loads, side, plain_ph, key)
        if side and num and den:
            ref = statistics.median(den)
            out["control" if role == "C" else side] = _summary([x / ref for x in num])
    recs = [v["median"] for k, v in out.items() if k != "control"]
    if len(recs) == 2:
        out["estimate"] = {"median": round(math.sqrt(recs[0] * recs[1]), 4)}
    return out


def verdict(ratios: dict) -> tuple[str, float | None]:
    """("met" | "missed" | "unresolved", the noise). The noise is the larger of the control's farthest ratio
    from 1 and each recorded side's own round-to-round half-range over its median (a tight control beside a
    recorded pair whose rounds swing says nothing either: seen on a 2-core dry run). With an 'estimate'
    (swap) that is judged, else every recorded side's median (pairs)."""
    ctl = ratios.get("control")
    if not ctl:
        return "unresolved", None
    sides = [v for k, v in ratios.items() if k not in ("control", "estimate")]
    noise = max([abs(1 - x) for x in ctl["ratios"]] + [(v["max"] - v["min"]) / 2 / v["median"] for v in sides])
    judged = [ratios["estimate"]] if "estimate" in ratios else sides
    if noise >= RESOLVE or not judged:
        return "unresolved", noise
    return ("met" if all(v["median"] >= GOAL for v in judged) else "missed"), noise


def side_stats(loads: list[dict], side: str, kind: str) -> dict:
    sel = [x for x in loads if x["side"] == side and x["kind"] == kind]
    lat = sorted(v for x in sel for v in x["lat_per_tok"])
    if not lat:
        return {}
    cpu = [x["cpu_s_per_tok"] for x in sel if x["cpu_s_per_tok"]]
    return {"side": side, "kind": kind, "loads": len(sel), "tok_s_median": round(statistics.median(x["tok_s"] for x in sel), 1),
            "lat_per_tok_ms_median": round(1e3 * statistics.median(lat), 3),
            "lat_per_tok_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
            "cpu_ms_per_tok_median": round(1e3 * statistics.median(cpu), 3) if cpu else None}


def table(res: dict) -> str:
    """Markdown: per model and side (per state in the swap design), ratio, the control's spread, the verdict."""
    lines = [f"live P/D + EAGLE, {res['device']}, model runner {res['runner']}, design {res['design']}, "
             f"{res['rounds_done']} rounds, max-num-seqs {res['max_num_seqs']}",
             "| model | side | state | tok/s recorded / plain (median, min-max) | noise (A/A control, rounds) | verdict | "
             "tok/s | ms/token median | p99 | CPU ms/token |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model, m in res["models"].items():
        sp = "-" if m["control_spread"] is None else f"{100 * m['control_spread']:.1f} %"
        for st in m["sides"]:
            side, kind = st["side"], st["kind"]
            r = m["tok_s"].get(side) if kind != "plain" else None
            rr = f"{r['median']} ({r['min']}-{r['max']})" if r else ""
            lines.append(f"| {model} | {side} | {kind} | {rr} | {sp} | {m['verdict'] if r else ''} | "
                         f"{st.get('tok_s_median')} | {st.get('lat_per_tok_ms_median')} | "
                         f"{st.get('lat_per_tok_ms_p99')} | {st.get('cpu_ms_per_tok_median')} |")
        if "estimate" in m["tok_s"]:
            lines.append(f"| {model} | A and B | geometric mean | {m['tok_s']['estimate']['median']} | {sp} | "
                         f"{m['verdict']} | | | | |")
    return "\n".join(lines)
