"""Generate a large schema-valid synthetic trace for benchmarks (check, TUI, report).

``generate(path, n_events, seed=0, inject_bugs=True)`` writes a P/D deployment with
spec decode: per engine step on each instance the scheduler events (sched.step,
sched.alloc), the worker's connector-metadata lifecycle (bind, per-layer has/save for the
target and drafter, clear), drafter windows, async accepted-count copies and reads, batch
row changes, and per finished request the NIXL transfer (request_finished on P,
remote_alloc / trim / read on D; P frees the request's blocks once sent, D finishes and frees
it when it leaves the batch, as the live traces record), and each process's ``proc.exit`` at
the end (its footer entry is ``complete``, as a merge recounts it). With ``inject_bugs`` a few of each bug class are mixed
in (lookahead-aligned prompts reported unclipped, early metadata clears, a DFlash window
past the allocation, reads after a row swap, a KV load failure whose rollback keeps its async
placeholders so the recompute is scheduled past the request). Returns a summary dict.
"""

from __future__ import annotations

import math
from collections import deque
import os
import random
import sys
from typing import Any

import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdtrace import schema  # noqa: E402
from pdtrace.tracefile.trace import make_header  # noqa: E402
from pdtrace.tracefile.typecheck import Signer  # noqa: E402

B = 16
NUM_BLOCKS = 100_000  # each instance's pool (sched.config num_blocks)
LAYERS_T = [f"model.layers.{i}.self_attn.attn" for i in range(8)]
LAYERS_D = ["drafter.layers.0.self_attn.attn"]


def generate(path: str, n_events: int, seed: int = 0, inject_bugs: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    dumps = orjson.dumps
    counts: dict[str, int] = {}
    procs: dict[int, dict] = {}
    n = 0
    t = 1_000_000_000
    bugs = {"lookahead": 0, "metadata": 0, "window": 0, "stale": 0, "kv_load": 0, "crossed": 0}
    bug_every = max(1, n_events // 5)  # a handful of each bug class per trace
    next_bug = {k: bug_every * (i + 1) // 2 for i, k in enumerate(bugs)}
    out = open(path + ".tmp", "wb")
    w = out.write
    signer = Signer()
    sign = signer.add

    def emit(kind: str, inst: str, role: str, pid: int, req: str | None = None, step: int | None = None,
             **fields: Any) -> None:
        nonlocal n, t
        t += rng.randint(200, 5000)
        ev = {"ev": kind, "t": t, "w": t + 1_700_000_000_000_000_000, "pid": pid, "role": role, "inst": inst}
        if step is not None:
            ev["step"] = step
        if req is not None:
            ev["req"] = req
        ev.update(fields)
        ev["id"] = n
        line = dumps(ev) + b"\n"
        sign(ev, line)  # as pdtrace's own writer does: type-checked, in the footer's digest
        w(line)
        n += 1
        counts[kind] = counts.get(kind, 0) + 1
        p = procs.get(pid)
        if p is None:
            p = procs[pid] = {"pid": pid, "role": role, "inst": inst, "events": 0, "dropped": 0, "complete": True}
        p["events"] += 1

    header = make_header(origin="synthetic", cmd=["bench/gen_trace.py", str(n_events)], instances=["P", "D"],
                         versions={"vllm": "0.32.0", "torch": "2.13.0", "nixl": "1.5.1", "python": "3.11",
                                   "pdtrace": "0.1.0"})
    w(dumps(header) + b"\n")
    PE, PW, DE, DW = 100, 101, 200, 201
    for inst, pid in (("P", PE), ("D", DE)):
        emit("sched.config", inst, "engine-core", pid, block_sizes=[B], group_kinds=["FullAttentionSpec"],
             num_lookahead_tokens=3 if inst == "P" else 0, num_spec_tokens=3, spec_method="eagle3",
             kv_role="kv_producer" if inst == "P" else "kv_consumer", connector="NixlConnector",
             async_scheduling=True, num_blocks=NUM_BLOCKS)
    emit("hooks.status", "D", "engine-core", DE, vllm="0.32.0",
         applied=["kv_load.invalid_blocks", "kv_load.failed_recving"], skipped={})
    step = 0
    rolled: dict[str, int] = {}  # D request -> tokens its next step schedules after a KV load rollback
    # each instance's block pool as vLLM keeps it: num_blocks ids, allocated from the front of the free queue,
    # freed to its end (so memory that follows the pool stays bounded on a 10M-event trace, as on a real one)
    pools = {inst: deque(range(1, NUM_BLOCKS)) for inst in ("P", "D")}

    def take(inst: str, k: int) -> list[int]:
        pool = pools[inst]
        return [pool.popleft() for _ in range(k)]
    rid = 0
    live_d: list[str] = []  # D requests decoding, in row order
    d_blocks: dict[str, list[int]] = {}
    d_len: dict[str, int] = {}
    d_start: dict[str, int] = {}  # D request -> its first decode step
    while n < n_events:
        step += 1
        # ---- P: prefill a few new requests, report them to D
        new = []
        for _ in range(rng.randint(1, 3)):
            rid += 1
            r = f"req-{rid}"
            bug_la = inject_bugs and n >= next_bug["lookahead"]
            plen = B * rng.randint(2, 40) if bug_la else rng.randint(20, 600) | 1
            new.append((r, plen, bug_la))
        p_blocks = {}
        for r, plen, bug_la in new:  # (as vLLM's schedule() records them: the allocations, then the step)
            nb = math.ceil((plen + 3) / B)
            blocks = p_blocks[r] = take("P", nb)
            emit("req.add", "P", "engine-core", PE, req=r, step=step, prompt_len=plen,
                 prompt_hash=f"{int(r.split('-')[1]):016x}", kv={"do_remote_prefill": False, "do_remote_decode": True})
            emit("sched.alloc", "P", "engine-core", PE, req=r, step=step, ok=True, block_ids=[blocks],
                 new_block_ids=[blocks], num_computed_tokens=0, num_new_tokens=plen, num_lookahead_tokens=3,
                 sched_lookahead_tokens=3, num_external_computed_tokens=0, num_new_computed_tokens=0,
                 delay_cache_blocks=False, prompt_len=plen)
        emit("sched.step", "P", "engine-core", PE, step=step, num_reqs=len(new), num_tokens=sum(p for _, p, _ in new),
             tokens={r: p for r, p, _ in new})
        for r, plen, bug_la in new:
            blocks = p_blocks[r]
            needed = math.ceil(plen / B)
            reported = blocks if bug_la else blocks[:needed]
            if bug_la:
                bugs["lookahead"] += 1
                next_bug["lookahead"] += bug_every
            emit("nixl.request_finished", "P", "engine-core", PE, req=r, step=step, side="P",
                 allocated_block_ids=[blocks], arg_block_ids=[blocks], block_ids=[reported],
                 remote_num_tokens=plen, num_computed_tokens=plen, prompt_len=plen, delay_free=True)
            local = take("D", needed)
            # D's side of it: the request with P's params (a dropped-params one without: kv-never-crossed)
            bug_x = inject_bugs and n >= next_bug["crossed"]
            if bug_x:
                bugs["crossed"] += 1
                next_bug["crossed"] += bug_every
            kv = None if bug_x else {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": r,
                                     "remote_num_tokens": plen}
            emit("req.add", "D", "engine-core", DE, req=r, step=step, prompt_len=plen,
                 prompt_hash=f"{int(r.split('-')[1]):016x}",
                 **({"kv": kv} if kv else {}))
            emit("sched.alloc", "D", "engine-core", DE, req=r, step=step, ok=True, block_ids=[local],
                 new_block_ids=[local], num_computed_tokens=0, num_new_tokens=plen if bug_x else 0,
                 num_lookahead_tokens=0, sched_lookahead_tokens=3, num_external_computed_tokens=0 if bug_x else plen,
                 num_new_computed_tokens=0, delay_cache_blocks=not bug_x, prompt_len=plen)
            remote_out = reported[-needed:]
            emit("nixl.remote_alloc", "D", "engine-core", DE, req=r, step=step, local_block_ids=[local],
                 remote_block_ids=[reported], remote_num_tokens=plen, num_external_tokens=plen, remote_req=r)
            emit("nixl.trim", "D", "worker", DW, req=r, step=step, local_in=[local], remote_in=[reported],
                 local_out=[local], remote_out=[remote_out])
            emit("nixl.read", "D", "worker", DW, req=r, step=step, local_block_ids=[local],
                 remote_block_ids=[remote_out], bytes=needed * 65536, handle=f"h{rid}", remote_req=r)
            emit("nixl.read_done", "D", "worker", DW, req=r, step=step, status="DONE", handle=f"h{rid}",
                 dur_ns=rng.randint(10_000, 900_000))
            emit("nixl.send_done", "P", "engine-core", PE, req=r, step=step)
            emit("req.finish", "P", "engine-core", PE, req=r, step=step, status="FINISHED_LENGTH_CAPPED",
                 num_computed_tokens=plen, num_output_tokens=1)
            # P frees the blocks once they are sent (NIXL's delay_free), as the live traces record
            emit("sched.free", "P", "engine-core", PE, req=r, step=step, block_ids=[blocks])
            pools["P"].extend(blocks)
            d_blocks[r] = local
            d_start[r] = step
            d_len[r] = plen
            live_d.append(r)
            emit("batch.add", "D", "worker", DW, req=r, step=step, row=len(live_d) - 1)
        # ---- P worker: connector metadata lifecycle
        bug_md = inject_bugs and n >= next_bug["metadata"]
        emit("kvmeta.bind", "P", "worker", PW, step=step, connector="NixlConnectorWorker", n_recv=0,
             n_save=len(new), n_send=0, reqs=[r for r, _, _ in new])
        emit("spec.phase", "P", "worker", PW, step=step, phase="target", edge="begin")
        for layer in LAYERS_T:
            emit("kvmeta.has", "P", "worker", PW, step=step, result=True, phase="target")
            emit("kvmeta.save_layer", "P", "worker", PW, step=step, layer=layer, phase="target")
        emit("spec.phase", "P", "worker", PW, step=step, phase="target", edge="end")
        if bug_md:
            emit("kvmeta.clear", "P", "worker", PW, step=step, phase="")
            bugs["metadata"] += 1
            next_bug["metadata"] += bug_every
        emit("spec.phase", "P", "worker", PW, step=step, phase="drafter", edge="begin", method="eagle3",
             layers=LAYERS_D)
        for layer in LAYERS_D:
            emit("kvmeta.has", "P", "worker", PW, step=step, result=not bug_md, phase="drafter")
            if not bug_md:
                emit("kvmeta.save_layer", "P", "worker", PW, step=step, layer=layer, phase="drafter")
        emit("spec.phase", "P", "worker", PW, step=step, phase="drafter", edge="end", method="eagle3")
        if not bug_md:
            emit("kvmeta.clear", "P", "worker", PW, step=step, phase="")
        emit("kvmeta.wait_for_save", "P", "worker", PW, step=step, phase="")
        # ---- D: decode with async spec decode
        while len(live_d) > 48:  # finish the oldest
            r = live_d.pop(0)
            emit("batch.remove", "D", "worker", DW, req=r, step=step, row=0)
            emit("req.finish", "D", "engine-core", DE, req=r, step=step, status="FINISHED_LENGTH_CAPPED",
                 num_computed_tokens=d_len[r], num_output_tokens=4 * (step - d_start.pop(r)))
            freed = d_blocks.pop(r)
            emit("sched.free", "D", "engine-core", DE, req=r, step=step, block_ids=[freed])
            pools["D"].extend(freed)
            if live_d:
                emit("batch.condense", "D", "worker", DW, step=step,
                     moves=[[q, i + 1, i] for i, q in enumerate(live_d)])
        d_tokens = {r: rolled.pop(r, 4) for r in live_d}
        emit("sched.step", "D", "engine-core", DE, step=step, num_reqs=len(live_d), num_tokens=sum(d_tokens.values()),
             tokens=d_tokens, spec={r: 3 for r in live_d})
        for r in live_d:
            d_len[r] += 4
            need = math.ceil((d_len[r] + 3) / B)
            if need > len(d_blocks[r]):
                nb_ = take("D", need - len(d_blocks[r]))
                d_blocks[r] = d_blocks[r] + nb_
            else:
                nb_ = []
            emit("sched.alloc", "D", "engine-core", DE, req=r, step=step, ok=True, block_ids=[d_blocks[r]],
                 new_block_ids=[nb_], num_computed_tokens=d_len[r] - 4, num_new_tokens=4, num_lookahead_tokens=3,
                 sched_lookahead_tokens=3, num_external_computed_tokens=0, num_new_computed_tokens=0,
                 delay_cache_blocks=False, prompt_len=d_len[r])
            bug_w = inject_bugs and n >= next_bug["window"]
            end = len(d_blocks[r]) * B + (2 if bug_w else -rng.randint(0, 3))
            if bug_w:
                bugs["window"] += 1
                next_bug["window"] += bug_every
            emit("spec.window", "D", "worker", DW, req=r, step=step, start=end - 4, end=end, method="eagle3",
                 group=0)
        ev_name = f"e{step}"
        emit("d2h.issue", "D", "worker", DW, step=step, buf="num_accepted_tokens_cpu", rows=list(live_d),
             event=ev_name)
        bug_s = inject_bugs and n >= next_bug["stale"] and len(live_d) >= 2
        if bug_s:
            a, b2 = live_d[0], live_d[1]
            emit("batch.swap", "D", "worker", DW, step=step + 1, i1=0, i2=1, req1=a, req2=b2)
            live_d[0], live_d[1] = b2, a
            bugs["stale"] += 1
            next_bug["stale"] += bug_every
        bug_kv = inject_bugs and n >= next_bug["kv_load"] and len(live_d) >= 4
        if bug_kv:  # a late report of a failed load: cut back to its first failed block, placeholders kept
            r = live_d[-1]
            failed_block = d_blocks[r][len(d_blocks[r]) // 2]
            cut = d_blocks[r].index(failed_block) * B
            emit("kvload.handled", "D", "engine-core", DE, step=step, source="invalid_blocks", policy="recompute",
                 groups=1, failed=[], block_ids=[failed_block], rescheduled=[r])
            emit("kvload.request", "D", "engine-core", DE, req=r, step=step, source="invalid_blocks",
                 policy="recompute", status="RUNNING", computed_before=d_len[r], computed=cut, placeholders_before=4,
                 placeholders=4, num_tokens=d_len[r], block_ids=[d_blocks[r]], action="recompute", retry=False)
            rolled[r] = d_len[r] - cut + 4 + 3  # vLLM #49250: num_tokens + placeholders - computed, + drafts
            bugs["kv_load"] += 1
            next_bug["kv_load"] += bug_every
        emit("d2h.done", "D", "worker", DW, step=step + 1, event=ev_name)
        for row, r in enumerate(live_d):
            v = rng.randint(1, 4)
            emit("acc.truth", "D", "worker", DW, req=r, step=step + 1, value=v, for_step=step)
            emit("acc.read", "D", "worker", DW, req=r, step=step + 1, row=row, value=v, event=ev_name,
                 event_done=True)
        if bug_s:  # the fixed runner keeps the buffer row order in sync from here on
            emit("d2h.issue", "D", "worker", DW, step=step + 1, buf="num_accepted_tokens_cpu", rows=list(live_d),
                 event=ev_name + "b")
    for pid, p in sorted(procs.items()):  # each process stopped recording (the footer's "complete")
        emit("proc.exit", p["inst"], p["role"], pid, events=p["events"] + 1, dropped=0, hook_errors={})
    footer = {"ev": schema.FOOTER, "events": n, "counts": counts, "dropped": 0, "hook_errors": {},
              "hooks": {"applied": [], "skipped": {}}, "processes": sorted(procs.values(), key=lambda p: p["pid"])}
    if signer.digest() is not None:
        footer["digest"] = signer.digest()
    w(dumps(footer) + b"\n")
    out.close()
    os.replace(path + ".tmp", path)
    return {"events": n, "steps": step, "requests": rid, "bugs": bugs}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="trace file to write (.jsonl)")
    ap.add_argument("-n", "--events", type=int, default=1_000_000, help="about how many events (default 1000000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--no-bugs", action="store_true", help="no injected bug of any of the five classes")
    a = ap.parse_args()
    print(generate(a.path, a.events, a.seed, inject_bugs=not a.no_bugs))
