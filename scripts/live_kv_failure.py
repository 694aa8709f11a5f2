"""KV that fails to load, made real in a live P/D run (``live_cpu_pd --kv-failures``; issue 36).

After the normal load, each decoder gets requests whose prefill ran on P for real but whose
``kv_transfer_params`` name a prefill instance that is gone: an engine id D has never met and a
side-channel port nobody listens on (what a proxy hands on when the P it routed to has died or
restarted under a new engine id). The fault is in the hand-over only; everything after it is
vLLM's own code: D's NIXL worker starts the handshake for that engine
(``_background_nixl_handshake``), zmq's 5 s receive timeout ends it (``handshake_failed``), the
worker queues the request's local blocks as failed (``get_block_ids_with_load_errors``), and the
scheduler handles them under the decoder's ``kv_load_failure_policy``: "fail" ends the request
with an error, "recompute" cuts its computed tokens back to the first failed block and
recomputes the prompt on D.

Last, on the "recompute" decoder, ``prefix-hit``: a normal request extending the prompt D just
recomputed, so D has a real prefix-cache hit and loads only the rest (the trim's positions).

Two shapes per decoder: ``gone`` (nothing of the prompt on D: every block fails, the recompute
restarts at token 0) and ``gone-prefix`` (the same prompt's first blocks decoded on D just before,
so D's prefix cache holds them and only the rest is loaded: the recompute restarts at the first
block past the cached prefix). The oracle for "recompute gave the right output" is P's own local
decode of the same prompt (no transfer), compared token for token.
"""

from __future__ import annotations

import sys
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pd_proxy  # noqa: E402
from live_load import _tokens, completion_body  # noqa: E402
from live_servers import free_port  # noqa: E402


def failure_plan(block_size: int) -> list[dict]:
    bs = block_size
    return [
        {"name": "gone", "len": 3 * bs + 5, "max_tokens": 12, "seed": 30},
        # the first 4 blocks of this prompt are decoded on D first ("warm"), then the whole one fails
        {"name": "gone-prefix", "len": 6 * bs + 3, "max_tokens": 12, "seed": 40, "warm_len": 4 * bs},
    ]


def _gone(kvp: dict, n: int) -> dict:
    """P's real transfer params, pointing at a prefill instance that is not there."""
    out = dict(kvp)
    out["remote_engine_id"] = f"{kvp.get('remote_engine_id')}-gone-{n}"
    out["remote_port"] = free_port()  # free: nothing listens there
    return out


def _post(url: str, body: dict) -> dict:
    """D's answer as data: the response, or the HTTP error vLLM gave (a failed request)."""
    try:
        resp = pd_proxy.post_json(url, body)
    except urllib.error.HTTPError as exc:
        return {"ok": False, "http_status": exc.code, "error": exc.read().decode(errors="replace")[:400]}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    c = (resp.get("choices") or [{}])[0]
    return {"ok": True, "finish_reason": c.get("finish_reason"), "tokens": _tokens(resp),
            "n_out": len(_tokens(resp))}


def send_failures(prefill_url: str, decoders: dict[str, tuple[str, str]], block_size: int) -> list[dict]:
    """Each decoder (name -> (url, policy)) gets the plan's requests with a gone P; each result
    carries D's answer and P's local decode of the same prompt. The decoders run at once (each its
    own requests in order): each failed load waits out D's handshake timeout, which one after the
    other added up."""
    from concurrent.futures import ThreadPoolExecutor

    per = len(failure_plan(block_size))
    with ThreadPoolExecutor(max_workers=max(1, len(decoders))) as pool:
        futures = [pool.submit(_one_decoder, prefill_url, i, name, url, policy, block_size, i * per)
                   for i, (name, (url, policy)) in enumerate(decoders.items())]
    return [r for f in futures for r in f.result()]


def _one_decoder(prefill_url: str, i: int, name: str, url: str, policy: str, block_size: int, n: int) -> list[dict]:
    out: list[dict] = []
    for r in failure_plan(block_size):
        r = {**r, "seed": r["seed"] + i, "decode": name, "policy": policy, "group": "kv-failure"}
        if r.get("warm_len"):  # its first blocks decoded on D for real (D's prefix cache)
            warm = {**r, "len": r["warm_len"], "max_tokens": 2}
            try:
                pd_proxy.disaggregated_completion(completion_body(warm), prefill_url, url)
                r["warm_ok"] = True
            except Exception as exc:
                r["warm_ok"], r["warm_error"] = False, str(exc)[:300]
        body = completion_body(r)
        p = pd_proxy.post_json(prefill_url + "/v1/completions", pd_proxy.prefill_body(body))
        kvp = p.get("kv_transfer_params") or {}
        n += 1
        gone = _gone(kvp, n)
        r["p_engine_id"], r["gone_engine_id"] = kvp.get("remote_engine_id"), gone["remote_engine_id"]
        r["remote_block_ids"], r["p_req"] = kvp.get("remote_block_ids"), kvp.get("remote_request_id")
        r.update(_post(url + "/v1/completions", {**body, "kv_transfer_params": gone}))
        out.append(_against_local(r, prefill_url, body))
    if policy == "recompute":  # after the recompute D holds that prompt's blocks: a normal request
        out.append(_prefix_hit(prefill_url, name, url, policy, block_size, 40 + i))  # that extends it
    return out


def _prefix_hit(prefill_url: str, name: str, url: str, policy: str, block_size: int, seed: int) -> dict:
    """A normal disaggregated request extending the prompt ``gone-prefix`` recomputed on D: D has a
    prefix-cache hit and loads only the rest from P (D's trim pairs its suffix with P's blocks;
    pdtrace places each block by D's own list). Oracle: P's local decode of the same prompt."""
    r = {"name": "prefix-hit", "len": 7 * block_size + 3, "max_tokens": 12, "seed": seed, "decode": name,
         "policy": policy, "group": "kv-failure"}
    body = completion_body(r)
    try:
        d = pd_proxy.disaggregated_completion(body, prefill_url, url)
        kvp = d.get("pd_proxy", {}).get("prefill_kv_transfer_params", {})
        r.update({"ok": True, "tokens": _tokens(d), "n_out": len(_tokens(d)), "p_req": kvp.get("remote_request_id"),
                  "remote_block_ids": kvp.get("remote_block_ids")})
    except Exception as exc:
        r.update({"ok": False, "error": str(exc)[:300]})
    return _against_local(r, prefill_url, body)


def _against_local(r: dict, prefill_url: str, body: dict) -> dict:
    """The oracle: P's own decode of the same prompt (no transfer), token for token."""
    local = _post(prefill_url + "/v1/completions", body)
    r["local_tokens"] = local.get("tokens")
    r["matches_local"] = bool(r["ok"] and local.get("ok") and r.get("tokens") == local.get("tokens"))
    return r
