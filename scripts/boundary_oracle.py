#!/usr/bin/env python3
"""Hold `pdtrace check` to oracles that are not pdtrace's own, for a block-boundary live P/D run
(``live_cpu_pd.py --load boundary:N``: the seed-000 run on vLLM 0.24.0 of docs/live-gpu.md).

    python scripts/boundary_oracle.py WORKDIR [--trace T] [--check C] [--json OUT]
    python scripts/boundary_oracle.py --tokens sample_traces/live_gpu_seed000_tokens.json --run v024 \
        --trace sample_traces/live_gpu_seed000_v024.jsonl.zst      # the bundled GPU run; a fresh `pdtrace check`

Per request of the load (WORKDIR/result.json), two oracles:
  * tokens: disaggregated (proxy: P prefills, D loads over NIXL) vs decoded locally on P alone;
    a first difference at a near tie (two candidates within live_boundary_load.TIE nats) is
    counted apart, since batch numerics can flip it with right KV;
  * mapping, from vLLM's own block lists as the trace recorded them, with no detector: D's
    ``nixl.remote_alloc.local_block_ids`` and P's ``nixl.request_finished.allocated_block_ids``
    are each in token-position order, so D's read pair local <- remote is right when the remote
    block sits at the same position in P's list as the local one in D's.
and pdtrace's verdict: an error finding of `pdtrace check` (WORKDIR/check.json, or a fresh run of it over the
trace) naming the request (its P or D id). Prints the table of docs/live-gpu.md: requests, mapping wrong, tokens diverged,
flagged, flagged with a right mapping (false), wrong mapping not flagged (missed), diverged not flagged.
Terms: a *near tie* is a first difference where two candidates were within live_boundary_load.TIE nats;
*false*: flagged while vLLM's block lists say the mapping was right; *missed*: a wrong mapping not flagged.
Exit 0 when no false and no missed flag, 1 otherwise, 2 on missing or mismatched input (a token file's run
whose requests are not in the trace, say), in one line.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path


def events(path: str) -> list[dict]:
    from pdtrace.tracefile.trace import load

    return list(load(path).events)


def mappings(ev: list[dict]) -> dict[str, dict]:
    """P request id -> {d_req, wrong: bool | None, shifts: [...], pairs: n} from vLLM's block lists."""
    p_alloc = {e["req"]: e.get("allocated_block_ids") for e in ev
               if e.get("ev") == "nixl.request_finished" and e.get("side") == "P"}
    d_of, d_local = {}, {}
    for e in ev:
        if e.get("ev") == "nixl.remote_alloc" and e.get("remote_req"):
            d_of[e["remote_req"]] = e["req"]
            d_local[e["req"]] = e.get("local_block_ids")
    reads = collections.defaultdict(list)
    for e in ev:
        if e.get("ev") == "nixl.read":
            reads[e["req"]].append(e)
    out: dict[str, dict] = {}
    for p_req, d_req in d_of.items():
        pa, dl = p_alloc.get(p_req), d_local.get(d_req)
        m = {"d_req": d_req, "wrong": None, "shifts": [], "pairs": 0}
        if pa is None or dl is None or not reads.get(d_req):
            out[p_req] = m
            continue
        wrong = False
        for rd in reads[d_req]:
            for g, (loc, rem) in enumerate(zip(rd.get("local_block_ids") or [], rd.get("remote_block_ids") or [])):
                dpos = {b: i for i, b in enumerate(dl[g])} if g < len(dl) else {}
                ppos = {b: i for i, b in enumerate(pa[g])} if g < len(pa) else {}
                for lb, rb in zip(loc, rem):
                    m["pairs"] += 1
                    if lb in dpos and rb in ppos and dpos[lb] != ppos[rb]:
                        wrong = True
                        m["shifts"].append(ppos[rb] - dpos[lb])
        m["wrong"] = wrong
        out[p_req] = m
    return out


def flagged(check: dict) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = collections.defaultdict(list)
    for f in check.get("findings", []):
        if f.get("severity") != "error":
            continue
        d = f.get("data") or {}
        for r in {f.get("req"), d.get("p_req"), d.get("d_req")} - {None}:
            by[r].append(f)
    return by


def fresh_check(trace: str) -> dict:
    """`pdtrace check TRACE --format json`, run now (the detectors of this checkout, not the recorded verdict)."""
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", trace, "--format", "json"], capture_output=True,
                       text=True, timeout=600)
    if r.returncode not in (0, 1, 4):
        raise ValueError(f"pdtrace check {trace}: exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def judge(requests: list[dict], ev: list[dict], check: dict) -> dict:
    maps, flags = mappings(ev), flagged(check)
    rows = []
    for r in requests:
        if not r.get("ok") or not r.get("p_req"):
            rows.append({"name": r.get("name"), "served": False, "error": r.get("error")})
            continue
        m = maps.get(r["p_req"], {})
        fs = flags.get(r["p_req"], []) + flags.get(m.get("d_req", ""), [])
        shifts = sorted({(f.get("data") or {}).get("groups", [{}])[0].get("shift") for f in fs} - {None})
        rows.append({"name": r["name"], "served": True, "len": r["len"], "p_req": r["p_req"], "d_req": m.get("d_req"),
                     "mapping_wrong": m.get("wrong"), "oracle_shifts": sorted(set(m.get("shifts", []))),
                     "diverged": r.get("diverged"), "near_tie": r.get("near_tie"), "first_diff": r.get("first_diff"),
                     "flagged": bool(fs), "kinds": sorted({f["kind"] for f in fs}), "flag_shifts": shifts})
    served = [x for x in rows if x["served"]]
    t = {
        "requests": len(rows), "served": len(served),
        "mapping_wrong": sum(bool(x["mapping_wrong"]) for x in served),
        "mapping_unknown": sum(x["mapping_wrong"] is None for x in served),
        "diverged": sum(bool(x["diverged"]) for x in served),
        "diverged_near_tie": sum(bool(x["diverged"] and x["near_tie"]) for x in served),
        "flagged": sum(x["flagged"] for x in served),
        "false": sum(x["flagged"] and x["mapping_wrong"] is False for x in served),
        "missed": sum(bool(x["mapping_wrong"]) and not x["flagged"] for x in served),
        "diverged_not_flagged": sum(bool(x["diverged"]) and not x["flagged"] for x in served),
        "diverged_right_mapping": sum(bool(x["diverged"]) and x["mapping_wrong"] is False for x in served),
        "errors_by_kind": dict(collections.Counter(f["kind"] for f in check.get("findings", [])
                                                   if f.get("severity") == "error")),
    }
    return {"table": t, "rows": rows}


def markdown(t: dict, label: str) -> str:
    cols = ("requests", "mapping_wrong", "diverged", "flagged", "false", "missed", "diverged_not_flagged")  # noqa
    return ("| run | " + " | ".join(cols) + " |\n| --- |" + " --- |" * len(cols) + "\n"
            f"| {label} | " + " | ".join(str(t[c]) for c in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", nargs="?", help="a live_cpu_pd.py --load boundary:N workdir")
    ap.add_argument("--trace", help="default: WORKDIR/merged.jsonl")
    ap.add_argument("--check", help="a `pdtrace check --format json` report (default: WORKDIR/check.json; "
                                    "without a workdir, `pdtrace check` is run now)")
    ap.add_argument("--tokens", help="instead of WORKDIR/result.json: a reduced token file "
                                     "(sample_traces/live_gpu_seed000_tokens.json) and --run, its run")
    ap.add_argument("--run", help="the run in --tokens (v024, v032)")
    ap.add_argument("--json", help="write the table and per-request rows here")
    ap.add_argument("--label", help="the table's run column (default: --run, or the workdir's name)")
    a = ap.parse_args(argv)
    if not a.workdir and not (a.tokens and a.run and a.trace):
        ap.error("give a WORKDIR, or --tokens, --run and --trace")
    wd = Path(a.workdir or ".")
    trace = a.trace or str(wd / "merged.jsonl")

    def fail(why: str) -> int:
        print(f"boundary_oracle: {why}", file=sys.stderr)
        return 2

    try:
        if a.tokens:
            runs = json.loads(Path(a.tokens).read_text()).get("runs") or {}
            if a.run not in runs:
                return fail(f"{a.tokens} has no run {a.run!r} (its runs: {', '.join(sorted(runs)) or 'none'})")
            requests = runs[a.run]["requests"]
        else:
            requests = json.loads((wd / "result.json").read_text()).get("requests", [])
        check = (json.loads(Path(a.check or wd / "check.json").read_text()) if a.check or a.workdir
                 else fresh_check(trace))
        ev = events(trace)
    except OSError as exc:
        return fail(f"cannot read {exc.filename}: {exc.strerror}")
    except ValueError as exc:  # a file that is not JSON, a trace pdtrace cannot read
        return fail(str(exc).replace("\n", " "))
    except Exception as exc:  # noqa: BLE001 - pdtrace's own errors (PdtraceError) name the file and line
        return fail(str(exc))
    out = judge(requests, ev, check)
    t = out["table"]
    if t["served"] and t["mapping_unknown"] == t["served"]:
        return fail(f"none of the {t['served']} requests' P ids is in {trace}: the requests ({a.tokens or wd}) are "
                    f"not this trace's run")
    label = a.label or a.run or wd.name
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["table"]))
    print(markdown(out["table"], label))
    for x in out["rows"]:
        if x.get("served") and (x["mapping_wrong"] or x["diverged"] or x["flagged"]):
            mapping = f"wrong {x['oracle_shifts']}" if x["mapping_wrong"] else "right"
            tokens = (f"diverge at {x['first_diff']}" + (" (near tie)" if x["near_tie"] else "")
                      if x["diverged"] else "equal")
            flag = f"flagged {','.join(x['kinds'])} shift {x['flag_shifts']}" if x["flagged"] else "not flagged"
            print(f"  {x['name']}: mapping {mapping}, tokens {tokens}, {flag}")
    if t["mapping_unknown"]:
        print(f"boundary_oracle: {t['mapping_unknown']} request(s) without a mapping in the trace: not judged",
              file=sys.stderr)
    return 0 if t["false"] == 0 and t["missed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
