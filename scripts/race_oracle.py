#!/usr/bin/env python3
"""vLLM #51571 on a recorded trace: the accepted-count reads that disagree with their request's own
count, found WITHOUT pdtrace's detectors, set beside what `pdtrace check`'s stale-read detector says.

    python scripts/race_oracle.py TRACE [TRACE ...]    # .jsonl or .jsonl.zst; prints one JSON object per trace

Two oracles; the first decides where the trace has what it needs (the runner's copied values for nearly
every read: recordings since 2026-11-27), else the second ("oracle" in the output says which):
  * the runner's own count: each `acc.read` held to the value the runner copied for that same request
    (`d2h.done` values in the rows `d2h.issue` names); different = a wrong read;
  * acc.truth and the align rule (older recordings, e.g. the project's shared evidence trace that
    tests/test_race_51571.py reads): each `acc.read` at step S held to the same request's `acc.truth` for
    step S-1; a disagreeing read that got 1 where the request's accepted tokens crossed a Mamba block
    boundary in step S-1 is the align postprocess's reset, not a bug (vLLM's
    `mamba_utils.postprocess_mamba_fused_kernel` stores 1 when `src_block_idx == dest_block_idx`),
    computed from the request's prompt length and accepted counts, block size from `sched.config`; the
    rest are wrong reads. This rule is approximate: on the 2026-11-27 H200 trace it called 3 reads align
    resets whose copied count was 3 or 4 (so they were wrong, and check's errors).
The goal: the wrong reads, and only they, are check's errors ("ok"). Warnings (reads through another
request's row whose value equalled their own) are counted in "findings", not judged.
Exit code 0 when "ok" for every trace; 1 otherwise; 2 when a file is missing.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def events(path: str) -> list[dict]:
    """The trace's events (header and footer apart), with their ids, as every pdtrace reader loads them."""
    from pdtrace.tracefile.trace import load

    return list(load(path).events)


def oracle(ev: list[dict]) -> dict:
    cfg = next((e for e in ev if e["ev"] == "sched.config"), None)
    bs = cfg["block_sizes"][0] if cfg else None
    plen = {e["req"]: e["prompt_len"] for e in ev if e["ev"] == "req.add"}
    truths: dict = collections.defaultdict(dict)
    for e in ev:
        if e["ev"] == "acc.truth":
            truths[e["req"]][e["for_step"]] = e["value"]

    def crosses(req, step) -> bool:  # tokens computed before the step: prompt + the counts accepted so far
        if bs is None or req not in plen:
            return False
        c = plen[req] + sum(v for s, v in truths[req].items() if s < step)
        return (c + truths[req][step]) // bs * bs >= c + 1

    reads = [e for e in ev if e["ev"] == "acc.read"]
    disagree, reset = set(), set()
    no_truth = 0
    for e in reads:
        t = truths[e["req"]].get(e["step"] - 1)
        if t is None:
            no_truth += 1
        elif t != e["value"]:
            disagree.add((e["req"], e["step"]))
            if e["value"] == 1 and crosses(e["req"], e["step"] - 1):
                reset.add((e["req"], e["step"]))
    # Where the trace has the copy's own values (d2h.done `values`, in the rows of d2h.issue `rows`):
    # the count the runner copied for this very request, the value the read should have got.
    issued = {e["event"]: e["rows"] for e in ev if e["ev"] == "d2h.issue" and e.get("rows")}
    copied = {e["event"]: e["values"] for e in ev if e["ev"] == "d2h.done" and e.get("values") is not None}
    judged, wrong_by_copy, reset_by_copy = set(), set(), set()
    for e in reads:
        rows, vals = issued.get(e.get("event")), copied.get(e.get("event"))
        if not rows or vals is None or e["req"] not in rows or len(vals) != len(rows):
            continue
        own = vals[rows.index(e["req"])]
        judged.add((e["req"], e["step"]))
        if e["value"] != own:
            wrong_by_copy.add((e["req"], e["step"]))
        t = truths[e["req"]].get(e["step"] - 1)
        if own == 1 and t not in (None, 1):
            reset_by_copy.add((e["req"], e["step"]))  # the runner copied 1 where it accepted more
    return {"block_size": bs, "reads": len(reads), "reads_without_truth": no_truth,
            "disagree": disagree, "align_reset": reset, "wrong": disagree - reset,
            "judged": judged, "wrong_by_copy": wrong_by_copy, "reset_by_copy": reset_by_copy}


def judge(path: str) -> dict:
    from pdtrace.detectors import STALE_ACCEPTED_COUNT_READ
    from pdtrace.detectors.stale_read import detect

    ev = events(path)
    o = oracle(ev)
    found = [f for f in detect(ev) if f.kind == STALE_ACCEPTED_COUNT_READ]
    by = collections.Counter(f.severity for f in found)
    errors = {(f.req, f.step) for f in found if f.severity == "error"}
    kind_of = {e["id"]: e["ev"] for e in ev}
    moves = collections.Counter(kind_of.get(f.data.get("moved_by"), "none named")
                                for f in found if f.severity == "error")
    counts = collections.Counter(e["ev"] for e in ev)
    # Which oracle decides: the runner's own copied counts where the trace records them for (nearly) every
    # read (recordings since 2026-11-27); else acc.truth with the align rule computed from the request.
    by_copy = o["reads"] and len(o["judged"]) >= 0.95 * o["reads"]
    if by_copy:
        wrong = o["wrong_by_copy"]
        ok = errors & o["judged"] == wrong and not errors - o["judged"]
    else:
        wrong = o["wrong"]
        # every wrong read an error, every error a disagreeing read (an error may also be an align reset:
        # a read from another request's row whose 1 equals what its own row got)
        ok = wrong <= errors <= o["disagree"]
    return {"trace": path, "events": len(ev),
            "requests": counts["req.add"], "copies": counts["d2h.issue"],
            "moves": {k: counts[k] for k in ("batch.add", "batch.remove", "batch.condense", "batch.swap")},
            "moves_with_rows": sorted({e.get("moves_with_rows") for e in ev if e["ev"] == "d2h.issue"}, key=str),
            "reads": o["reads"], "oracle": "runner's copied count" if by_copy else "acc.truth + align rule",
            "wrong": len(wrong), "findings": dict(by), "error_moves": dict(moves), "ok": bool(ok),
            "wrong_not_flagged": sorted(map(list, wrong - errors))[:10],
            "flagged_not_wrong": sorted(map(list, errors - wrong))[:10],
            # the details of both oracles
            "reads_with_copy_values": len(o["judged"]), "wrong_by_copy": len(o["wrong_by_copy"]),
            "runner_copied_1_for_more": len(o["reset_by_copy"]),
            "errors_without_copy_values": len(errors - o["judged"]),
            "reads_without_truth": o["reads_without_truth"], "disagree_with_truth": len(o["disagree"]),
            "align_rule_resets": len(o["align_reset"]), "wrong_by_truth_and_align_rule": len(o["wrong"])}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    ok = True
    for p in argv:
        if not Path(p).exists():
            print(f"race_oracle: {p}: no such file", file=sys.stderr)
            return 2
        r = judge(p)
        ok &= r["ok"]
        print(json.dumps(r))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
