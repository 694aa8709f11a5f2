"""Benchmark: cost of the scheduler + NIXL hooks on a real vLLM Scheduler loop (CPU).

256 requests (prompt 64 tokens, 48 output tokens), EAGLE k=3 speculative decoding, NIXL
connector configured (kv_producer; requests carry no kv_transfer_params, so it is plain
serving through a connector-enabled scheduler). Each step: Scheduler.schedule(), a
ModelRunnerOutput (one accepted draft token per request), update_from_output(),
update_draft_token_ids(). Untraced: hooks not installed. Traced: hooks installed and a
shard-file recorder with its writer thread (the production path). N alternating runs after
a gc.freeze() of the warmed-up heap (what vLLM's engine core does after start-up) and a
collection before each run; prints the traced/untraced ratio of the best and of the median
runs (goal <= 1.03), and the same with what the writer thread still had to flush at the end
of each traced loop added (the writer's whole cost, had it all landed inside the loop).

    python bench/hooks.py [--reqs 256] [--repeat 9]
    python bench/hooks.py --instructions [--gc-phases 3]   # the same loop, counted in instructions

``--instructions`` runs an untraced and a traced loop, each in its own process under
valgrind's callgrind (Debian package ``valgrind``), counting the instructions executed from
the start of the loop to the end of the writer's flush of that loop's events (the writer's
whole cost; its periodic wake-ups are turned off so the count does not depend on timing).
Instruction counts repeat exactly from run to run and do not move with the load on a shared
machine, so they can judge a change of a few tenths of a percent that CPU time cannot. They
ignore cache misses, which this scheduler loop has few of. One thing still moves them: where
the cyclic GC's collections land in the loop. vLLM runs with the GC on (after a freeze), so
the loops do too, and a change that allocates a few more or fewer objects can move the
traced count by up to 7M instructions (0.6%) through GC alone. So the pair is counted
``--gc-phases`` times (default 3), each time with the GC's generation counters started at
another phase (``_gc_phase``), and the median ratio is the verdict. About 4 minutes on 2
cores.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loop(h, cfg, n_reqs: int, prompt_len: int, out_len: int, tag: str) -> tuple[float, int]:
    """Runs the loop (``pd_harness.drive`` with EAGLE drafts); returns (process CPU seconds,
    steps). CPU time of the whole process counts the writer thread's work too and is less
    disturbed by other load on a shared machine than wall time."""
    sched = h.build_scheduler("P", cfg)
    for i in range(n_reqs):
        sched.add_request(h._make_request(f"{tag}-{i}", [10 + (i * 7 + j) % 900 for j in range(prompt_len)],
                                          out_len, None, cfg.block_size))
    t0 = time.process_time()
    steps = h.drive(sched, draft_k=cfg.num_spec_tokens)
    return time.process_time() - t0, steps


def _count_one(mode: str, a: argparse.Namespace) -> int:
    """Child of ``--instructions``: one warmed-up loop with callgrind's instrumentation on
    around it (mode "untraced" or "traced")."""
    import subprocess

    from pdtrace import hooks
    from pdtrace.record import recorder
    from pdtrace.record.recorder import Recorder
    from pdtrace.testing import pd_harness as h

    cfg = h.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, num_blocks=16384,
                     max_num_seqs=256, max_num_batched_tokens=8192)
    h.build_vllm_config("P", cfg)
    rec = None
    if mode == "traced":
        h.install_scheduler_hooks()
        d = tempfile.mkdtemp(prefix="pdtrace-bench-")
        # no periodic flushes: the one flush below does all of the writer's work
        rec = Recorder.to_shard_dir(d, flush_interval=1e6)
        recorder.set_current(rec)
    loop(h, cfg, 16, a.prompt, 8, "warm")
    loop(h, cfg, 16, a.prompt, 8, "warm2")
    gc.collect()
    gc.freeze()
    before = 0
    if rec is not None:
        rec.flush()
        before = rec.emitted
    pad = _gc_phase(a.phase)
    ctl = ["callgrind_control", "-i"]
    subprocess.run(ctl + ["on", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
    loop(h, cfg, a.reqs, a.prompt, a.out, "x")
    if rec is not None:
        rec.flush()
    subprocess.run(ctl + ["off", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
    if rec is not None:
        print(f"events {rec.emitted - before}")
        rec.close()
    hooks.uninstall_all()
    del pad
    return 0


def _gc_phase(i: int) -> list:
    """Start the cyclic GC's generation counters at phase ``i`` (0 = just after the freeze):
    ``3 * i`` young collections (each advances the middle generation's counter, so its
    collections, which traverse every young survivor such as a new scheduler's block pool,
    come at another point of the loop) and ``233 * i`` live empty lists (the same for the
    young generation's own counter). The objects are returned for the caller to keep."""
    for _ in range(3 * i):
        gc.collect(0)
    return [[] for _ in range(233 * i)]


def count_instructions(a: argparse.Namespace) -> int:
    import re
    import shutil
    import subprocess

    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("--instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONHASHSEED="0")  # same dict/set orders in both processes
    # no address-space randomization either: sets and dicts keyed by object ids then iterate
    # in the same order every run, and the counts repeat exactly
    norand = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    print(f"scheduler loop: {a.reqs} requests, EAGLE k=3, NIXL connector configured (instructions, callgrind)")
    ratios, overheads, events = [], [], "?"
    for phase in range(a.gc_phases):
        procs = {}
        for mode in ("untraced", "traced"):
            cmd = norand + ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
                   sys.executable, os.path.abspath(__file__), "--count-one", mode, "--phase", str(phase),
                   "--reqs", str(a.reqs), "--prompt", str(a.prompt), "--out", str(a.out)]
            procs[mode] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        counts = {}
        for mode, p in procs.items():
            out, err = p.communicate()
            m = re.search(r"Collected : (\d+)", err)
            if p.returncode != 0 or m is None:
                print(f"{mode} run failed (rc {p.returncode}):\n{err[-2000:]}", file=sys.stderr)
                return 1
            counts[mode] = int(m.group(1))
            ev = re.search(r"events (\d+)", out)
            if ev:
                events = ev.group(1)
        u, t = counts["untraced"], counts["traced"]
        ratios.append(t / u)
        overheads.append(t - u)
        print(f"GC phase {phase}: untraced {u:,}  traced {t:,}  overhead {t - u:,}  ratio {t / u:.4f}", flush=True)
    n_ev = int(events) if events != "?" else 0
    mo = statistics.median(overheads)
    print(f"writer flush included; {events} events; median overhead {mo:,.0f} instructions, "
          f"{mo / max(1, n_ev):,.0f} per event")
    print(f"ratio traced/untraced: {statistics.median(ratios):.4f} instructions, median of {len(ratios)} GC phases "
          f"(range {min(ratios):.4f}-{max(ratios):.4f}; goal <= 1.03)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions under valgrind's callgrind instead of timing (deterministic)")
    ap.add_argument("--gc-phases", type=int, default=3,
                    help="with --instructions: loop pairs counted, each starting at another phase of the "
                         "cyclic GC's generation counters; the median ratio is the verdict (default 3)")
    ap.add_argument("--count-one", choices=("untraced", "traced"), help=argparse.SUPPRESS)
    ap.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.count_one:
        return _count_one(a.count_one, a)
    if a.instructions:
        return count_instructions(a)

    from pdtrace import hooks
    from pdtrace.record import recorder
    from pdtrace.record.recorder import Recorder
    from pdtrace.testing import pd_harness as h

    cfg = h.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, num_blocks=16384,
                     max_num_seqs=256, max_num_batched_tokens=8192)
    h.build_vllm_config("P", cfg)
    loop(h, cfg, 16, a.prompt, 8, "warm")  # warm-up (imports, caches)
    # As vLLM's engine core does after start-up (vllm.utils.gc_utils.freeze_gc_heap): move
    # the import-time heap out of the cyclic GC's reach. Each timed run starts after a
    # collection, so a full collection owed by an earlier run does not land in a later one.
    gc.collect()
    gc.freeze()
    base, traced, drains, events = [], [], [], 0
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.repeat):
            hooks.uninstall_all()
            gc.collect()
            dt, steps = loop(h, cfg, a.reqs, a.prompt, a.out, f"u{r}")
            base.append(dt)
            h.install_scheduler_hooks()
            rec = Recorder.to_shard_dir(os.path.join(d, str(r)))  # writer thread live, as in production
            prev = recorder.set_current(rec)
            gc.collect()
            try:
                dt2, steps2 = loop(h, cfg, a.reqs, a.prompt, a.out, f"t{r}")
                t0 = time.process_time()
                rec.flush()  # what the writer still owes for this loop (counted separately)
                drains.append(time.process_time() - t0)
            finally:
                recorder.set_current(prev)
                rec.close()
            traced.append(dt2)
            events = rec.emitted
            assert steps == steps2, (steps, steps2)
    hooks.uninstall_all()
    b, t = min(base), min(traced)
    mb, mt = statistics.median(base), statistics.median(traced)
    md = statistics.median(drains)
    print(f"scheduler loop: {a.reqs} requests, {steps} steps, EAGLE k=3, NIXL connector configured, "
          f"{a.repeat} alternating runs each (process CPU time)")
    print(f"untraced best {b * 1e3:.1f} ms, median {mb * 1e3:.1f} ms ({b / steps * 1e6:.0f} us/step)  "
          f"runs: {[round(x * 1e3, 1) for x in base]}")
    print(f"traced   best {t * 1e3:.1f} ms, median {mt * 1e3:.1f} ms ({t / steps * 1e6:.0f} us/step)  "
          f"runs: {[round(x * 1e3, 1) for x in traced]}")
    print(f"events per traced run: {events}; writer backlog flushed after each loop: median {md * 1e3:.1f} ms")
    print(f"ratio traced/untraced: {t / b:.3f} best, {mt / mb:.3f} median (goal <= 1.03)")
    print(f"ratio with the writer's backlog counted: {(mt + md) / mb:.3f} median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
