"""The load of a live P/D run (``live_cpu_pd``): token-id prompts some of whose lengths are
block-size multiples, sent through the proxy sequentially and concurrently, plus a local
reference decode on P whose tokens are the oracle for the disaggregated ones."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pd_proxy  # noqa: E402
from live_servers import MODEL_NAME  # noqa: E402


# ----------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------

def make_prompt(n: int, seed: int, period: int = 12) -> list[int]:
    """n token ids in 4..999; periodic so the ngram proposer finds matches."""
    base = [4 + ((seed * 131 + i * 37) % 990) for i in range(period)]
    return [base[i % period] for i in range(n)]


def request_plan(block_size: int) -> list[dict]:
    """Sequential and concurrent requests; prompt lengths multiples of block_size or not."""
    bs = block_size
    seq = [
        {"name": "mult2", "len": 2 * bs, "max_tokens": 16, "seed": 1},
        {"name": "odd", "len": 2 * bs + 13, "max_tokens": 16, "seed": 2},
        {"name": "mult4", "len": 4 * bs, "max_tokens": 16, "seed": 3},
        {"name": "mult4-again", "len": 4 * bs, "max_tokens": 16, "seed": 3},  # prefix-cache hit on P and D
        {"name": "short", "len": bs - 5, "max_tokens": 12, "seed": 4},
    ]
    # Sent in this order, 0.3 s apart, each decoding more than the one before: on D the earlier
    # request of any two that share the batch holds the lower row (it was added first) and
    # finishes first while the later one still runs, so InputBatch.condense() moves the later one
    # down into the freed row (batch.condense), and its later accepted-count reads come from its
    # new row. Any overlap of two gives a condense. (The plan before, c-long 256 / c-mid 224 /
    # c-short 16 / c-last 64 tokens, needed c-short and c-last to overlap on D in that row order;
    # in a CI run of 2026-11-27 P's prefills reached D 2.4 s apart on the loaded cores, only
    # c-long and c-mid overlapped, and the higher row finished first: no condense.)
    conc = [
        {"name": "c-1", "len": 3 * bs, "max_tokens": 64, "seed": 5, "gap": 0.3},
        {"name": "c-2", "len": 3 * bs + 7, "max_tokens": 128, "seed": 6, "gap": 0.3},
        {"name": "c-3", "len": bs + 1, "max_tokens": 192, "seed": 8, "gap": 0.3},
        {"name": "c-4", "len": 5 * bs, "max_tokens": 256, "seed": 7, "gap": 0.0},
    ]
    for r in seq:
        r["group"] = "sequential"
    for r in conc:
        r["group"] = "concurrent"
    return seq + conc


def completion_body(r: dict) -> dict:
    return {"model": MODEL_NAME, "prompt": make_prompt(r["len"], r["seed"]), "max_tokens": r["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def _tokens(resp: dict) -> list:
    c = resp["choices"][0]
    return c.get("token_ids") or c.get("text", "").split()


def warm_decoders(prefill_url: str, decode_urls: list[str], block_size: int, tries: int = 3) -> list[dict]:
    """One request P -> each decoder before the load, retried: D's first pull makes the NIXL
    handshake with P, whose reply vLLM waits for 5 s at most (nixl/base_worker.py
    _nixl_handshake: zmq.RCVTIMEO 5000). With more servers than cores P's side channel can answer
    later than that (seen with 1P2D on 2 cores, and with 1P1D in a CI run: handshake_setup_failed,
    zmq.Again in _nixl_handshake, HTTP 500), as any proxy would, retry. Each attempt is returned, failed ones included (they are in the trace too)."""
    out = []
    for i, d in enumerate(decode_urls):
        body = completion_body({"len": block_size + 3, "max_tokens": 4, "seed": 50 + i})
        for attempt in range(1, tries + 1):
            try:
                pd_proxy.disaggregated_completion(body, prefill_url, d)
                out.append({"decode": d, "attempt": attempt, "ok": True})
                break
            except Exception as exc:
                out.append({"decode": d, "attempt": attempt, "ok": False, "error": str(exc)[:300]})
                time.sleep(2.0)
    return out


def send_load(proxy_url: str, prefill_url: str, plan: list[dict]) -> list[dict]:
    results: list[dict] = []

    def one(r: dict) -> dict:
        t = time.monotonic()
        try:
            resp = pd_proxy.post_json(proxy_url + "/v1/completions", completion_body(r))
            kvp = resp.get("pd_proxy", {}).get("prefill_kv_transfer_params", {})
            return {**r, "ok": True, "s": round(time.monotonic() - t, 2), "n_out": len(_tokens(resp)),
                    "usage": resp.get("usage"), "tokens": _tokens(resp),
                    "remote_block_ids": kvp.get("remote_block_ids"), "kv_keys": sorted(kvp)}
        except Exception as exc:
            body = exc.read().decode(errors="replace")[:500] if hasattr(exc, "read") else ""
            return {**r, "ok": False, "s": round(time.monotonic() - t, 2), "error": f"{exc} {body}"}

    for r in plan:
        if r["group"] == "sequential":
            results.append(one(r))
    conc = [r for r in plan if r["group"] == "concurrent"]
    slots: list = [None] * len(conc)
    threads = [threading.Thread(target=lambda i=i, r=r: slots.__setitem__(i, one(r))) for i, r in enumerate(conc)]
    for th, r in zip(threads, conc):
        th.start()
        time.sleep(r.get("gap", 0.3))
    for th in threads:
        th.join()
    results += slots
    # Reference: the first request decoded locally on P (no transfer) must give the same tokens.
    ref = plan[0]
    try:
        local = pd_proxy.post_json(prefill_url + "/v1/completions", completion_body(ref))
        pd = next(x for x in results if x["name"] == ref["name"])
        results.append({"name": "reference-local-on-P", "group": "reference", "ok": True,
                        "len": ref["len"], "max_tokens": ref["max_tokens"], "n_out": len(_tokens(local)),
                        "tokens": _tokens(local),
                        "matches_disaggregated": pd.get("ok") and _tokens(local) == pd.get("tokens")})
    except Exception as exc:
        results.append({"name": "reference-local-on-P", "group": "reference", "ok": False, "error": str(exc)})
    return results
