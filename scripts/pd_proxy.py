#!/usr/bin/env python3
"""A small prefill/decode proxy for a NixlConnector deployment (stdlib only).

    python scripts/pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

POST /v1/completions (non-streaming):
  1. the request goes to the prefill instance with max_tokens=1 and
     kv_transfer_params {do_remote_decode: true, do_remote_prefill: false, remote_*: null},
     so P computes the prompt's KV, keeps the blocks for D to read and answers with its own
     kv_transfer_params (remote_engine_id, remote_block_ids, remote_host, remote_port, ...);
  2. the ORIGINAL request goes to the decode instance with P's kv_transfer_params, so D
     pulls the KV over NIXL instead of recomputing it, and D's answer is returned.
Both halves carry one X-Request-Id (vLLM builds its internal request id from it): push mode
(NixlPushConnector) pairs P's finished request with D's registration by that id.
GET /health answers 200 when both instances do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def post_json(url: str, body: dict, timeout: float = 300.0, request_id: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if request_id:  # vLLM's API server builds its internal id from it: "cmpl-<X-Request-Id>-<i>-<hex>"
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def prefill_body(body: dict) -> dict:
    p = dict(body)
    p["max_tokens"] = 1
    p.pop("min_tokens", None)
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return p


def disaggregated_completion(body: dict, prefill: str, decode: str, path: str = "/v1/completions") -> dict:
    """Run one request through P then D; return D's response (with P's kv params attached
    under "pd_proxy" for debugging)."""
    # One X-Request-Id for both halves, as vLLM's own P/D proxies send it: push mode
    # (NixlPushConnector) pairs P's finished request with D's registration by
    # get_base_request_id, so two unrelated ids never meet and D waits until P's lease ends.
    rid = uuid.uuid4().hex
    p = post_json(prefill.rstrip("/") + path, prefill_body(body), request_id=rid)
    kvp = p.get("kv_transfer_params")
    if not kvp:
        raise RuntimeError(f"prefill instance returned no kv_transfer_params: {str(p)[:300]}")
    d_body = dict(body)
    d_body["kv_transfer_params"] = kvp
    d = post_json(decode.rstrip("/") + path, d_body, request_id=rid)
    d["pd_proxy"] = {"prefill_kv_transfer_params": kvp, "prefill_id": p.get("id")}
    return d


class _Handler(BaseHTTPRequestHandler):
    server_version = "pd_proxy/1"
    prefill = ""
    decode = ""  # one URL, or several separated by commas (xPyD: requests go round-robin)
    _next = None  # itertools.cycle over the decode URLs, set by make_server

    @classmethod
    def pick_decode(cls) -> str:
        with cls._lock:
            return next(cls._next)

    def log_message(self, fmt, *args):  # quiet
        pass

    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        if self.path != "/health":
            return self._send(404, {"error": "not found"})
        for url in (self.prefill, *self.decode.split(",")):
            try:
                urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5).read()
            except (OSError, urllib.error.URLError) as exc:
                return self._send(503, {"error": f"{url}: {exc}"})
        self._send(200, {"ok": True})

    def do_POST(self):  # noqa: N802
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._send(404, {"error": "not found"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if body.get("stream"):
                return self._send(400, {"error": "pd_proxy: streaming is not supported"})
            self._send(200, disaggregated_completion(body, self.prefill, self.pick_decode(), self.path))
        except urllib.error.HTTPError as exc:
            self._send(exc.code, {"error": exc.read().decode(errors="replace")[:2000]})
        except Exception as exc:  # report, keep serving
            self._send(502, {"error": f"{type(exc).__name__}: {exc}"})


def make_server(port: int, prefill: str, decode: str, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"prefill": prefill, "decode": decode,
                                            "_next": itertools.cycle(decode.split(",")),
                                            "_lock": threading.Lock()})
    srv = ThreadingHTTPServer((host, port), handler)
    srv.daemon_threads = True
    return srv


def serve_in_thread(port: int, prefill: str, decode: str) -> ThreadingHTTPServer:
    srv = make_server(port, prefill, decode)
    threading.Thread(target=srv.serve_forever, name="pd_proxy", daemon=True).start()
    return srv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="prefill/decode proxy for NixlConnector")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer instance")
    ap.add_argument("--decode", required=True,
                    help="base URL of the kv_consumer instance, or several separated by commas (round-robin)")
    a = ap.parse_args(argv)
    srv = make_server(a.port, a.prefill, a.decode, a.host)
    print(f"pd_proxy on http://{a.host}:{a.port} -> P {a.prefill}, D {a.decode}", file=sys.stderr)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
