"""P's KV lease running out before D reads, made live (``live_cpu_pd --expired-lease S``; issue 51).

P starts with a short NIXL lease (``kv_connector_extra_config.kv_lease_duration`` = S seconds; vLLM's
default is 30). Each prompt is prefilled on P for a remote decode; every other one is handed to D at
once (the control), the others only after the lease has run out, while P keeps serving other prompts
(its scheduler hands the released blocks to them): the shape of a router or queue that holds a request
longer than the lease (aws-samples/aws-do-eks PR #84: 8 of 42 requests on a 30 s lease; vLLM #52234).
Nothing is faked: D reads with P's own kv_transfer_params, vLLM's own code releases and reuses.

The oracle is never pdtrace: each prompt's greedy tokens decoded locally on P before anything else,
against the tokens D returned; and P's own log, whose "Potentially invalid KV blocks for unrecognized
request X were retrieved by a decode worker" names each request read after its lease ran out.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pd_proxy  # noqa: E402
from live_load import _tokens, completion_body  # noqa: E402

READ_AFTER_EXPIRY = re.compile(r"Potentially invalid KV blocks for unrecognized request (\S+) were retrieved")
OTHERS = 48  # prompts P serves while a held request waits
RELEASED = re.compile(r"Releasing expired KV blocks for request (\S+) which were retrieved by (\d+)")


def send_expired(prefill_url: str, decode_url: str, block_size: int, lease: float, n: int = 4) -> dict:
    """``n`` prompts through P then D, the odd ones handed to D only after ``lease`` + 2 s of P serving other
    prompts. Returns each request: its P request id, whether it was held, the local tokens and D's."""
    reqs = []
    for i in range(n):
        held = bool(i % 2)
        r = {"name": f"{'held' if held else 'prompt'}-{i}", "len": 4 * block_size + 22 + 5 * i, "max_tokens": 8,
             "seed": 100 + i, "held": held, "group": "expired-lease"}
        body = completion_body(r)
        try:
            r["local"] = _tokens(pd_proxy.post_json(prefill_url + "/v1/completions", body))  # the oracle, on P alone
            p = pd_proxy.post_json(prefill_url + "/v1/completions", pd_proxy.prefill_body(body))
            kvp = p.get("kv_transfer_params") or {}
            r["p_req"] = kvp.get("remote_request_id")
            others = 0
            if held:  # the lease runs out; then P serves other prompts: the first step reaps the expired lease,
                time.sleep(lease + 0.5)  # and the others cycle P's free blocks (48 x 7 > its 256) onto those blocks
                for others in range(1, OTHERS + 1):
                    other = {"len": 6 * block_size + 8, "seed": 1000 + 100 * i + others, "max_tokens": 2}
                    pd_proxy.post_json(prefill_url + "/v1/completions", completion_body(other))
            r["others_on_p"] = others
            d = pd_proxy.post_json(decode_url + "/v1/completions", {**body, "kv_transfer_params": kvp})
            r.update({"ok": True, "tokens": _tokens(d), "d_id": d.get("id")})
            r["equal_local"] = r["tokens"] == r["local"]
        except Exception as exc:
            r.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
        reqs.append(r)
    # one more step on P, so that it handles D's last read notification (and logs it) before the servers stop
    pd_proxy.post_json(prefill_url + "/v1/completions", completion_body({"len": block_size, "seed": 7, "max_tokens": 1}))
    return {"lease_s": lease, "requests": reqs}


def p_log_says(log_text: str) -> dict:
    """What P's own log says: the requests whose lease ran out, and those D read after that."""
    return {"released": sorted({m.group(1) for m in RELEASED.finditer(log_text)}),
            "read_after_expiry": sorted({m.group(1) for m in READ_AFTER_EXPIRY.finditer(log_text)})}
