"""The block-boundary load of a live P/D run (``live_cpu_pd.py --load boundary:N``; issue 52 item 1, seed 000).

N requests, each a distinct token-id prompt (no two share a first block, so D has no prefix-cache hit
and holds exactly the blocks it loads), whose lengths walk every residue modulo the block size from
one to eight blocks: block-aligned prompts, the ones whose lookahead slots spill into a further block
on P (length mod block size >= block size - num_spec), and the rest. Greedy, ignore_eos.

Oracle (not pdtrace): each prompt is sent twice, disaggregated through the proxy (P prefills, D loads
P's KV over NIXL and decodes) and locally on P alone (no transfer), and the two token lists are
compared. ``logprobs`` of the first token where they part says whether it was a near tie (two
candidates within ``TIE`` nats on either side), which numerics of a different batch can flip with
right KV; a wrong KV mapping gives a different distribution altogether.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pd_proxy  # noqa: E402
from live_load import make_prompt  # noqa: E402
from live_servers import MODEL_NAME  # noqa: E402

TIE = 0.05  # nats: two candidates this close are a near tie


def boundary_plan(block_size: int, n: int, max_tokens: int = 16) -> list[dict]:
    """n requests; length i walks residues 0..bs-1 mod block_size over 1..8 blocks (seed = i, distinct)."""
    bs = block_size
    plan = []
    for i in range(n):
        blocks = 1 + (i // bs) % 8
        resid = (i * 5) % bs  # 5 is prime to 16 and 32: every residue within each run of bs requests
        length = blocks * bs + resid
        plan.append({"name": f"b{i:03d}-len{length}", "len": length, "max_tokens": max_tokens, "seed": 1000 + i,
                     "aligned": length % bs == 0})
    return plan


def _body(r: dict, logprobs: bool = True) -> dict:
    b = {"model": MODEL_NAME, "prompt": make_prompt(r["len"], r["seed"]), "max_tokens": r["max_tokens"],
         "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    return {**b, "logprobs": 2} if logprobs else b


def _post(url: str, r: dict, logprobs: bool = True) -> tuple[dict, bool]:
    """The response, and whether it carries logprobs: a server that refuses them (HTTP 400) is asked
    again without, so a release that cannot return logprobs still gives the token oracle. ``logprobs``
    False: asked without from the start."""
    if not logprobs:
        return pd_proxy.post_json(url, _body(r, logprobs=False)), False
    try:
        return pd_proxy.post_json(url, _body(r)), True
    except Exception as exc:
        if getattr(exc, "code", None) != 400:
            raise
        return pd_proxy.post_json(url, _body(r, logprobs=False)), False


def _out(resp: dict) -> tuple[list, list]:
    c = resp["choices"][0]
    toks = c.get("token_ids") or []
    top = (c.get("logprobs") or {}).get("top_logprobs") or []
    return toks, top


def _near_tie(top: list, i: int) -> bool:
    if i >= len(top) or not top[i]:
        return False
    vals = sorted(top[i].values(), reverse=True)
    return len(vals) >= 2 and vals[0] - vals[1] < TIE


def send_boundary(proxy_url: str, prefill_url: str, plan: list[dict], concurrency: int = 8,
                  logprobs: bool = True) -> list[dict]:
    """Every request disaggregated (``concurrency`` at a time), then every prompt locally on P. ``logprobs``
    False: the tokens alone (no near-tie verdicts)."""

    def pd(r: dict) -> dict:
        t = time.monotonic()
        try:
            resp, lp = _post(proxy_url + "/v1/completions", r, logprobs)
            kvp = resp.get("pd_proxy", {}).get("prefill_kv_transfer_params", {})
            toks, top = _out(resp)
            return {**r, "ok": True, "s": round(time.monotonic() - t, 2), "tokens": toks, "top": top,
                    "p_req": kvp.get("remote_request_id"), "remote_block_ids": kvp.get("remote_block_ids"),
                    "remote_num_tokens": kvp.get("remote_num_tokens"), "logprobs": lp}
        except Exception as exc:
            body = exc.read().decode(errors="replace")[:300] if hasattr(exc, "read") else ""
            return {**r, "ok": False, "error": f"{type(exc).__name__}: {exc} {body}"[:400]}

    def local(r: dict) -> dict:
        try:
            resp = _post(prefill_url + "/v1/completions", r, logprobs)[0]
            return {"ok": True, **dict(zip(("tokens", "top"), _out(resp)))}
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}

    with ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(pd, plan))
    with ThreadPoolExecutor(concurrency) as ex:
        refs = list(ex.map(local, plan))
    for r, ref in zip(res, refs):
        r["local_ok"] = ref["ok"]
        if not (r["ok"] and ref["ok"]):
            r["diverged"] = None
            continue
        a, b = r["tokens"], ref["tokens"]
        r["local_tokens"] = b
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        r["diverged"] = first is not None
        r["first_diff"] = first
        r["near_tie"] = first is not None and (_near_tie(r["top"], first) or _near_tie(ref["top"], first))
        r.pop("top", None)  # large; the tokens say the rest
    return res
