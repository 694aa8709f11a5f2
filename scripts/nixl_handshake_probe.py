"""How long NIXL's add_remote_agent (loadRemoteMD, the step of vLLM's NIXL
handshake after its "Transfer plan" line) takes on this host, outside vLLM:
docs/live-cpu.md, "The 1P2D warm-up stall".

One agent plays P: vLLM 0.32.0's agent config (nixl_agent_config(num_threads=4,
capture_telemetry=True), UCX), 16 MiB of DRAM registered, then get_new_notifs()
without pause, as P's worker does while its engine steps. Each trial is a fresh
process playing D: the same config, its own 16 MiB, add_remote_agent(P's
metadata) from a second thread while its main thread polls get_new_notifs()
(D's worker stepping meanwhile), then one 1 MiB READ from P.

    .venv/bin/python scripts/nixl_handshake_probe.py [--trials N] [--spinners N]
        [--stop-p]

One line per trial: seconds in add_remote_agent, D's polls meanwhile, the
READ's seconds. The agents keep NIXL's own progress-thread delay (0: the thread
spins), not the 1000 us the live servers get from scripts/live_site. Needs nixl
(bash scripts/install.sh --live)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def _nixl():
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            mod = __import__(name, fromlist=["nixl_agent"])
            return mod.nixl_agent, mod.nixl_agent_config
        except ImportError:
            continue
    sys.exit("nixl_handshake_probe: nixl is not installed (bash scripts/install.sh --live)")


def _agent(name: str):
    import numpy as np

    nixl_agent, nixl_agent_config = _nixl()
    ag = nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))
    buf = np.ones(16 << 20, dtype=np.uint8)
    ag.register_memory(ag.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    return ag, buf


def play_p(md_path: str) -> None:
    ag, buf = _agent("P")
    with open(md_path + ".tmp", "wb") as f:
        f.write(ag.get_agent_metadata())
    with open(md_path + ".addr", "w") as f:
        f.write(str(buf.ctypes.data))
    os.rename(md_path + ".tmp", md_path)
    while True:  # P's worker while its engine steps: each step polls the notifications
        ag.get_new_notifs()


def play_d(md_path: str, name: str) -> None:
    ag, buf = _agent(name)
    with open(md_path, "rb") as f:
        md = f.read()
    with open(md_path + ".addr") as f:
        raddr = int(f.read())
    took: dict = {}

    def handshake():
        t = time.monotonic()
        took["remote"] = ag.add_remote_agent(md)
        took["s"] = time.monotonic() - t

    th = threading.Thread(target=handshake)
    polls = 0
    th.start()
    while th.is_alive():  # D's worker keeps stepping while the handshake runs
        ag.get_new_notifs()
        polls += 1
    stopped = os.environ.get("NIXL_PROBE_STOPPED_P")
    if stopped:  # --stop-p: P was stopped for the metadata load; the READ needs it running
        os.kill(int(stopped), signal.SIGCONT)
    loc = ag.get_xfer_descs([(buf.ctypes.data, 1 << 20, 0)], "DRAM")
    rem = ag.get_xfer_descs([(raddr, 1 << 20, 0)], "DRAM")
    t = time.monotonic()
    h = ag.initialize_xfer("READ", loc, rem, took["remote"])
    ag.transfer(h)
    while ag.check_xfer_state(h) == "PROC":
        pass
    print(f"{name}: add_remote_agent {took['s']:.3f} s ({polls} polls meanwhile), READ {time.monotonic() - t:.3f} s "
          f"{ag.check_xfer_state(h)}", flush=True)


def main() -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=6, help="D processes, one after another (default 6)")
    ap.add_argument("--spinners", type=int, default=0, help="busy Python loops beside: a host with more to run "
                    "than cores (default 0)")
    ap.add_argument("--stop-p", action="store_true", help="SIGSTOP P while each D loads its metadata, to see whether "
                    "loading it waits on P (P runs again for the READ)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--md", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "P":
        play_p(a.md)
        return 0
    if a.role:
        play_d(a.md, a.role)
        return 0
    tmp = tempfile.mkdtemp(prefix="nixl-probe-")
    md = os.path.join(tmp, "p.md")
    me = [sys.executable, os.path.abspath(__file__), "--md", md, "--role"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    p = subprocess.Popen(me + ["P"], **quiet)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.spinners)]
    try:
        for _ in range(600):
            if os.path.exists(md):
                break
            time.sleep(0.1)
        else:
            print("nixl_handshake_probe: P's agent did not start in 60 s", file=sys.stderr)
            return 1
        for i in range(1, a.trials + 1):
            env = dict(os.environ)
            if a.stop_p:
                p.send_signal(signal.SIGSTOP)
                env["NIXL_PROBE_STOPPED_P"] = str(p.pid)
            try:
                r = subprocess.run(me + [f"D{i}"], capture_output=True, text=True, timeout=300, env=env)
            finally:
                if a.stop_p:
                    p.send_signal(signal.SIGCONT)
            line = [x for x in r.stdout.splitlines() if x.startswith(f"D{i}:")]
            print(line[0] if line else f"D{i}: failed (rc {r.returncode}): {r.stderr.strip()[-300:]}", flush=True)
    finally:
        for q in [p, *spin]:
            q.kill()
            q.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
