"""KV that never crossed, made live (``live_cpu_pd --dropped-params``; issue 51).

After the normal load, one decoder gets requests whose prefill ran on P for real (P prefilled
them for a remote decode and returned its kv_transfer_params), half of them handed to D with
those params and half without: the router's fault, the shape of smg PR #1622 (its gRPC path
never passed NIXL's parameters to D, so every decode worker recomputed the whole prefill, with
correct outputs). The fault is in the hand-over only; D runs vLLM's own code: with no params its
connector loads nothing and D prefills the prompt itself.

The oracle is D's own counters, never pdtrace: each response's ``usage`` and, for the whole run,
``vllm:prompt_tokens_by_source`` on D's /metrics (prompt tokens computed on D, hit in its prefix
cache, loaded by the KV transfer, counted by vLLM at admission).
"""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pd_proxy  # noqa: E402
from live_load import _tokens, completion_body  # noqa: E402

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_METRIC = re.compile(r'^vllm:prompt_tokens_by_source(?:_total)?\{([^}]*)\}\s+([0-9.eE+-]+)$')


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """D's own counters (its /metrics): prompt tokens per source, summed over its engines."""
    text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
    out = dict.fromkeys(SOURCES, 0.0)
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m:
            src = dict(kv.split("=", 1) for kv in re.findall(r'(\w+="[^"]*")', m.group(1)))
            s = src.get("source", "").strip('"')
            out[s] = out.get(s, 0.0) + float(m.group(2))
    return out


def send_dropped(prefill_url: str, decode_url: str, block_size: int, n: int = 6) -> dict:
    """``n`` prompts through P then D, every other one handed to D without P's params. Returns
    each request (``dropped``, P's request id, D's usage and tokens) and D's counters before and
    after."""
    before = prompt_tokens_by_source(decode_url)
    reqs = []
    for i in range(n):
        r = {"name": f"dropped-{i}" if i % 2 else f"handed-{i}", "len": 2 * block_size + 5 + 7 * i,
             "max_tokens": 4, "seed": 60 + i, "dropped": bool(i % 2), "group": "dropped-params"}
        body = completion_body(r)
        try:
            p = pd_proxy.post_json(prefill_url + "/v1/completions", pd_proxy.prefill_body(body))
            kvp = p.get("kv_transfer_params") or {}
            r["p_req"] = kvp.get("remote_request_id")
            d_body = dict(body) if r["dropped"] else {**body, "kv_transfer_params": kvp}  # the FAULT: left out
            d = pd_proxy.post_json(decode_url + "/v1/completions", d_body)
            r.update({"ok": True, "usage": d.get("usage"), "tokens": _tokens(d), "d_id": d.get("id")})
        except Exception as exc:
            r.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
        reqs.append(r)
    return {"requests": reqs, "d_metrics_before": before, "d_metrics_after": prompt_tokens_by_source(decode_url)}
