"""The builders of the named scenarios (``scenarios.SCENARIOS``): each returns a function that
runs real vLLM code through ``pd_harness`` / ``worker_sim`` / ``race_sim`` and gives a
``Scenario`` with its expected findings from what was built (the injected fault and the real
block lists), never from the detectors. See ``scenarios`` for the table and the samples."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from pdtrace.detectors.base import (
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION,
    KV_INVARIANT,
    KV_LOAD_FAILURE_RECOVERY,
    KV_NEVER_CROSSED,
    LOOKAHEAD_MISALIGNMENT,
    METADATA_CLEARED_BEFORE_DRAFTER,
    STALE_ACCEPTED_COUNT_READ,
)


@dataclasses.dataclass
class Scenario:
    name: str
    description: str
    events: list[dict[str, Any]]
    expected: list[str]  # detector kinds that must fire (sorted, unique)
    provenance: dict[str, Any]
    # bug classes `check` must report "not checked": those that apply to the configuration
    # built but whose events the scenario does not record (or whose hooks were made to fail)
    not_checked: list[str] = dataclasses.field(default_factory=list)


def _pd():
    from pdtrace.testing import pd_harness

    return pd_harness


def _ws():
    from pdtrace.testing import worker_sim

    return worker_sim


REAL_SCHED = ("vLLM 0.32.0 Scheduler / KVCacheManager / NIXL connector scheduler side (P and D), "
              "NixlBaseConnectorWorker._apply_prefix_caching, on CPU with pdtrace hooks")
SIM_NIXL = ("nixl.read / nixl.read_done / nixl.send_done (the harness runs no worker process; "
            "live_cpu_pd_eagle.jsonl has real ones)")


def _misaligned(r: Any, block_size: int) -> bool:
    """Oracle from the real block lists: did some D block get a P block other than the one
    holding the same tokens? (attention group 0; P's block i holds tokens [i*B, (i+1)*B))."""
    p_blocks = r.p_allocated[0]
    need = math.ceil(r.prompt_len / block_size)
    expected = p_blocks[:need]
    local, remote = r.trim_local[0], r.trim_remote[0]
    # D's blocks are the uncomputed suffix: the last len(local) blocks of the prompt
    exp_tail = expected[len(expected) - len(local):] if local else []
    return list(remote) != list(exp_tail)


def _misaligned_group(r: Any, g: int, block_size: int) -> bool:
    """``_misaligned`` for attention group ``g`` (sliding-window groups included: P's block i
    still holds tokens [i*B, (i+1)*B); blocks that left the window are the null block 0)."""
    need = math.ceil(r.prompt_len / block_size)
    expected = r.p_allocated[g][:need]
    local, remote = r.trim_local[g], r.trim_remote[g]
    exp_tail = expected[len(expected) - len(local):] if local else []
    return list(remote) != list(exp_tail)


def _attn_kinds(attn: tuple[str, ...], fault: bool, spec: str = "eagle", prompt_len: int = 80,
                window: int = 32) -> Callable[[], Scenario]:
    """Sliding-window / chunked-local attention groups (issue 19 point 7) on the real scheduler:
    P's sliding groups report only their in-window tail (earlier blocks are the null block)."""
    def build() -> Scenario:
        pd = _pd()
        k = 3
        cfg = pd.PDConfig(spec_method=spec, num_spec_tokens=k, block_size=16, attn=attn, window=window)
        r = pd.run_pd_request(cfg, prompt_len, faults=("old_p_block_rule",) if fault else ())
        shifted = [g for g in range(len(attn)) if _misaligned_group(r, g, 16)]
        if not fault:
            assert not shifted, f"oracle: fixed vLLM pairs every group's blocks ({shifted} shifted)"
        # (a shifted mapping is D reading other positions' KV: the invariant's error too, issue 59)
        expected = [LOOKAHEAD_MISALIGNMENT, KV_INVARIANT] if fault and shifted else []
        return Scenario("", "", r.events, expected, {
            "real": [REAL_SCHED], "simulated": [SIM_NIXL],
            "faults": ["old_p_block_rule: P reports its full allocation (pre-fix rule of vLLM PR #44151)"] if fault else [],
            "facts": {"prompt_len": prompt_len, "num_spec_tokens": k, "block_size": 16, "attn": list(attn),
                      "window": window, "p_allocated": r.p_allocated, "p_reported": r.p_reported,
                      "d_local": r.d_local, "trim_remote": r.trim_remote, "shifted_groups": shifted},
        }, _unrecorded() if spec in ("eagle", "dflash") else [])
    return build


# What each builder records (an oracle from construction, not from the detectors): the
# scheduler-side P/D run feeds the lookahead class, and the KV-load class (D's scheduler with
# the kv_load hooks applied and no load failing: checked, nothing to flag); the worker simulations add one
# class each. The accepted-count copy exists only on hybrid models (else "does not apply"),
# the drafter and metadata classes apply to every EAGLE / DFlash P/D pair built here.
_WORKER_CLASSES = (METADATA_CLEARED_BEFORE_DRAFTER, DRAFTER_WINDOW_OUTSIDE_ALLOCATION)


def _unrecorded(*recorded: str, hybrid: bool = False) -> list[str]:
    applies = _WORKER_CLASSES + ((STALE_ACCEPTED_COUNT_READ,) if hybrid else ())
    return sorted(k for k in applies if k not in recorded)


def _lookahead(prompt_len: int, k: int, fault: bool, *, hybrid: bool = False) -> Callable[[], Scenario]:
    def build() -> Scenario:
        pd = _pd()
        cfg = pd.PDConfig(spec_method="eagle", num_spec_tokens=k, block_size=16, hybrid=hybrid)
        r = pd.run_pd_request(cfg, prompt_len, faults=("old_p_block_rule",) if fault else ())
        extra = len(r.p_allocated[0]) - math.ceil(prompt_len / 16)
        expected = [LOOKAHEAD_MISALIGNMENT, KV_INVARIANT] if fault and _misaligned(r, 16) else []
        if fault and extra > 0:
            assert expected, "oracle: P reported its lookahead block(s), D must be misaligned"
        return Scenario("", "", r.events, expected, {
            "real": [REAL_SCHED], "simulated": [SIM_NIXL],
            "faults": ["old_p_block_rule: P reports its full allocation (pre-fix rule of vLLM PR #44151)"] if fault else [],
            "facts": {"prompt_len": prompt_len, "num_spec_tokens": k, "block_size": 16, "hybrid": hybrid,
                      "p_allocated": r.p_allocated, "p_reported": r.p_reported, "d_local": r.d_local,
                      "trim_remote": r.trim_remote, "trailing_lookahead_blocks": max(extra, 0)},
        }, _unrecorded(hybrid=hybrid))
    return build


def _dflash(fault: bool) -> Callable[[], Scenario]:
    def build() -> Scenario:
        pd, ws = _pd(), _ws()
        k, prompt_len, bs = 3, 29, 16
        cfg = pd.PDConfig(spec_method="dflash", num_spec_tokens=k, block_size=bs)
        r = pd.run_pd_request(cfg, prompt_len, faults=("old_dflash_lookahead",) if fault else ())
        p_alloc = [e for e in r.events if e["ev"] == "sched.alloc" and e.get("req") == r.p_req and e.get("ok")]
        first = p_alloc[0]
        rec = pd.new_recorder()
        rec.set_role(role="worker", inst="P", why="worker simulation")
        wins = ws.drafter_window(rec, [r.p_req], [prompt_len], "buggy" if fault else "fixed", method="dflash",
                                 k=k, step=first.get("step", 0), block_ids={r.p_req: first["block_ids"][0]},
                                 block_size=bs)
        rec.flush()
        held = len(first["block_ids"][0]) * bs
        outside = any(w["end"] > held for w in wins)
        expected = [DRAFTER_WINDOW_OUTSIDE_ALLOCATION, KV_INVARIANT] if outside else []
        if fault:
            assert outside, "oracle: with k (not k+1) lookahead slots the DFlash window must overflow"
        return Scenario("", "", _merge(r.events, rec.events), expected, {
            "real": [REAL_SCHED],
            "simulated": [SIM_NIXL, "spec.window: the DFlash drafter's KV write window after the first prefill "
                          "(start = prompt_len, end = start + k + 1), computed as vLLM 0.32.0's drafter does"],
            "faults": ["old_dflash_lookahead: the scheduler reserves k instead of k+1 lookahead slots "
                       "(pre-fix rule of vLLM PR #42971 / #43733)"] if fault else [],
            "facts": {"prompt_len": prompt_len, "num_spec_tokens": k, "block_size": bs,
                      "p_first_alloc": first["block_ids"], "windows": wins},
        }, _unrecorded(DRAFTER_WINDOW_OUTSIDE_ALLOCATION))
    return build


def _metadata(fault: bool) -> Callable[[], Scenario]:
    def build() -> Scenario:
        pd, ws = _pd(), _ws()
        cfg = pd.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
        r = pd.run_pd_request(cfg, 20)
        rec = pd.new_recorder()
        rec.set_role(role="worker", inst="P", why="worker simulation")
        res = ws.connector_metadata_steps(rec, [r.p_req], 2, "buggy" if fault else "fixed", method="eagle")
        rec.flush()
        expected = [METADATA_CLEARED_BEFORE_DRAFTER] if res["has_false"]["drafter"] else []
        if fault:
            assert expected, "oracle: clearing before the drafter must leave drafter layers without metadata"
        return Scenario("", "", _merge(r.events, rec.events), expected, {
            "real": [REAL_SCHED, "KVConnectorBase_V1 bind/clear/has_connector_metadata/save_kv_layer/wait_for_save "
                     "on a real NixlConnector instance (CPU)"],
            "simulated": [SIM_NIXL, "the model runner's call order (target forward, drafter propose) and "
                          "spec.phase events (GPU-only)"],
            "faults": ["clear-before-drafter: clear_connector_metadata() right after the target forward "
                       "(pre-fix rule of vLLM PR #34529)"] if fault else [],
            "facts": {"saved": res["saved"], "has_false": res["has_false"]},
        }, _unrecorded(METADATA_CLEARED_BEFORE_DRAFTER))
    return build


def _stale(fault: bool, row_moves: bool, grow: bool = False) -> Callable[[], Scenario]:
    def build() -> Scenario:
        pd, ws = _pd(), _ws()
        cfg = pd.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, async_scheduling=True)
        pair = pd.make_pair(cfg)
        runs = [pd.run_pd_request(cfg, n, pair=pair) for n in (16, 20, 33, 48)]
        rec = pd.new_recorder()
        rec.set_role(role="worker", inst="D", why="worker simulation")
        # grow: two requests join the batch at step 4 (after the condense at step 3), in rows past the
        # ones step 3's copy wrote; InputBatch.add_request sets their counts
        grown = {4: ["grow-a", "grow-b"]} if grow else None
        res = ws.accepted_counts_steps(rec, [r.d_req for r in runs], 6, "buggy" if fault else "fixed",
                                       row_moves=row_moves, k=3, grow=grown)
        rec.flush()
        events = [e for r in runs for e in r.events]
        # the pair's setup events appear in every run's list: keep one copy
        seen: set[int] = set()
        uniq = []
        for e in events:
            if id(e) not in seen:
                seen.add(id(e))
                uniq.append(e)
        stale = [x for x in res["reads"] if x["truth"] is not None and x["value"] != x["truth"]]
        racy = fault  # buggy mode reads without waiting for the copy's event: a race even when the value matches
        expected = [STALE_ACCEPTED_COUNT_READ] if (stale or racy) else []
        return Scenario("", "", _merge(uniq, rec.events), expected, {
            "real": [REAL_SCHED + " (AsyncScheduler)", "InputBatch add_request/swap_states/condense on CPU tensors"],
            "simulated": [SIM_NIXL, "the D2H copy of num_accepted_tokens, its CUDA event and the CPU read in "
                          "_prepare_inputs (GPU-only), acc.truth"],
            "faults": ["racy-accepted-count-read: _prepare_inputs reads the CPU copy without waiting for the "
                       "copy's event, after row moves (pre-fix behaviour of vLLM PR #45100)"] if fault else [],
            "facts": {"row_moves": row_moves, "reads": res["reads"][:12], "mismatches": len(res.get("mismatches") or []),
                      "grown": res.get("grown", [])},
        }, _unrecorded(STALE_ACCEPTED_COUNT_READ))
    return build


def _race(order: str, fix: bool) -> Callable[[], Scenario]:
    """vLLM #51571 (open upstream): the align-mode copy lands before / after the step's row moves
    (pdtrace.testing.race_sim: real InputBatch and reorder); oracle: each decode's value read against
    its own count in the real buffer."""
    def build() -> Scenario:
        from pdtrace.testing import race_sim

        pd = _pd()
        rec = pd.new_recorder()
        rec.set_role(role="worker", inst="D", why="worker simulation")
        out = race_sim.run(rec, order, fix=fix)
        rec.flush()
        expected = [STALE_ACCEPTED_COUNT_READ] if out["wrong"] else []
        return Scenario("", "", list(rec.events), expected, {
            "real": ["InputBatch add_request/remove_request/condense/swap_states and "
                     "reorder_batch_to_split_decodes_and_prefills on CPU"],
            "simulated": ["the align postprocess's D2H copy and its CUDA event (landing " + order + " the row "
                          "moves), the accepted-count branch of _prepare_inputs as vLLM 0.32.0 has it"],
            "faults": ["#51599 approach (labelled, not merged upstream): the copy goes to a runner-owned "
                       "snapshot rows do not move"] if fix else [],
            "facts": {"order": order, "rows": out["rows"], "reads": out["reads"], "wrong": out["wrong"]},
        }, _unrecorded(STALE_ACCEPTED_COUNT_READ, hybrid=True) + [LOOKAHEAD_MISALIGNMENT]
            # a worker alone: no scheduler, so nothing says whether a load failed or how it was handled,
            # nor which blocks its steps read
            + [KV_LOAD_FAILURE_RECOVERY, KV_NEVER_CROSSED, KV_INVARIANT])
    return build


REAL_KV_LOAD = ("vLLM 0.32.0 Scheduler / AsyncScheduler failure path (update_from_output -> "
                "_handle_failed_recving / _handle_invalid_blocks -> _update_requests_with_invalid_blocks), D's "
                "NIXL worker's _log_failure and get_block_ids_with_load_errors, on CPU with pdtrace hooks")
SIM_KV_LOAD = ("the failed NIXL read itself: the worker's failure log, its invalid blocks queued and the "
               "KVConnectorOutput (finished_recving / failed_recving / invalid_block_ids) as vLLM 0.32.0's worker "
               "reports them")
SIM_KV_SYNC = ("the report of a failed synchronous load: the running request's blocks in "
               "KVConnectorOutput.invalid_block_ids (queued through D's NIXL worker's get_block_ids_with_load_errors), "
               "as vLLM's own tests report them; the model's forward (sampled tokens fed back)")


def _kv_load(policy: str, *, when: str = "load", how: str = "both", failed: tuple[int, ...] | None = None,
             async_scheduling: bool = False, fix: bool = False) -> Callable[[], Scenario]:
    """A KV load that fails on D (pdtrace.testing.kv_load_sim); expected findings from vLLM's own
    numbers: the tokens it scheduled next against what the request had left, how it finished."""
    def build() -> Scenario:
        from pdtrace.testing import kv_load_sim

        cfg = _pd().PDConfig(spec_method="", async_scheduling=async_scheduling)
        r = kv_load_sim.failed_load(cfg, policy=policy, how=how, when=when, failed=failed, max_tokens=8, steps=10,
                                    fix_placeholders=fix)
        reqs = r.of("kvload.request")
        last = reqs[-1]
        left = last["num_tokens"] - (r.computed_after or 0)
        over = policy == "recompute" and bool(r.scheduled_after) and r.scheduled_after[0] > left
        expected = [KV_LOAD_FAILURE_RECOVERY] if over else []
        if policy == "fail":
            assert r.finished == "FINISHED_ERROR", "oracle: vLLM fails the request under the 'fail' policy"
        elif not over:
            assert r.finished == "FINISHED_LENGTH_CAPPED", "oracle: the recompute runs to the request's end"
        return Scenario("", "", r.events, expected, {
            "real": [REAL_KV_LOAD], "simulated": [SIM_KV_LOAD if when == "load" else SIM_KV_SYNC],
            "faults": [],
            "fixture": ["LABELLED FIX (not in vLLM 0.32.0): _update_requests_with_invalid_blocks resets the "
                        "affected requests' num_output_placeholders (vLLM PR #45430 / #49252)"] if fix else [],
            "own_bug": ("vLLM 0.32.0's own AsyncScheduler: _update_requests_with_invalid_blocks does not roll back "
                        "num_output_placeholders (open upstream: #49250, #45138)") if over else "",
            "facts": {"policy": policy, "when": when, "how": r.how, "d_local": r.d_local, "failed": failed,
                      "computed_after": r.computed_after, "scheduled_after": r.scheduled_after,
                      "left_after_rollback": left, "placeholders_after": last["placeholders"],
                      "finished": r.finished},
        }, _no_read(r.events))
    return build


def _no_read(events: list[dict]) -> list[str]:
    """The invariant (kv-invariant) is not checked where D loads KV and no worker event says the load landed
    (the harness simulates no nixl.read for these): what the scenario recorded, not what the detector says."""
    loads = {e["req"] for e in events if e["ev"] == "sched.alloc" and e.get("num_external_computed_tokens")}
    lost = {e["req"] for e in events if e["ev"] == "kvload.request" and e.get("source") == "failed_recving"}
    return [KV_INVARIANT] if loads - lost and not any(e["ev"] == "nixl.read" for e in events) else []


SCHED_KINDS = ("sched.config", "sched.step", "req.add", "req.finish", "sched.alloc", "sched.free")
NIXL_HOOK_KINDS = ("nixl.request_finished", "nixl.remote_alloc", "nixl.trim")


def failing_recorder(kinds: tuple[str, ...]) -> Any:
    """FAULT (pdtrace's own): an in-memory recorder that raises when a hook records one of
    ``kinds``, as a hook broken by a vLLM change would. vLLM runs on (the hook wrappers
    swallow the exception and record ``hook.error``); the harness's own simulated events
    are emitted with ``sim=True`` and pass."""
    from pdtrace.record.recorder import Recorder

    class HookFault(Recorder):
        def _check(self, kind: str, fields: dict) -> None:
            if kind in kinds and not fields.get("sim"):
                raise RuntimeError(f"injected: recording {kind} fails")

        def emit(self, kind: str, req: str | None = None, step: int | None = None, **fields: Any) -> None:
            self._check(kind, fields)
            super().emit(kind, req, step, **fields)

        def put(self, kind: str, req: str | None, step: int | None, fields: dict[str, Any]) -> None:
            self._check(kind, fields)
            super().put(kind, req, step, fields)

    return HookFault.in_memory(role="engine-core", redact=True)


def _hook_failure(kinds: tuple[str, ...], fault: bool) -> Callable[[], Scenario]:
    def build() -> Scenario:
        pd = _pd()
        cfg = pd.PDConfig(spec_method="eagle", num_spec_tokens=1, block_size=16)
        rec = failing_recorder(kinds)
        r = pd.run_pd_request(cfg, 16, faults=("old_p_block_rule",) if fault else (), pair=pd.make_pair(cfg, rec))
        errors = sorted({e["hook"] for e in r.events if e["ev"] == "hook.error"})
        assert errors, "oracle: the injected recording fault must surface as hook.error events"
        # the pre-fix P rule still shifts D's read (nixl.read recorded): the invariant says so, its class not checked
        # (vLLM's own lists, read by the harness: P holds a lookahead block past the prompt's one, which the old
        # rule reports and D's end-trim reads; the NIXL hooks' failure hides the report, not the read)
        inv = [KV_INVARIANT] if fault and len(r.p_blocks[0]) > 1 and "sched.alloc" not in kinds else []
        return Scenario("", "", r.events, inv, {
            "real": [REAL_SCHED], "simulated": [SIM_NIXL],
            "faults": [f"hook-failure: pdtrace's recording of {', '.join(kinds)} raises (hooks: {', '.join(errors)})"]
            + (["old_p_block_rule: P reports its full allocation (pre-fix rule of vLLM PR #44151)"] if fault else []),
            "facts": {"hook_errors": errors, "p_reported": r.p_reported, "trim_remote": r.trim_remote},
        }, [LOOKAHEAD_MISALIGNMENT, KV_INVARIANT, *_unrecorded()]
            # no sched.config recorded: nothing rules the accepted-count class out either; the
            # scheduler's hooks failed, so its handling of a failed load is not recorded
            + ([STALE_ACCEPTED_COUNT_READ, KV_LOAD_FAILURE_RECOVERY, KV_NEVER_CROSSED] if "sched.config" in kinds
               else []))
    return build


# Two P/D pairs built in one process before either ran a request: the scheduler events (sched.step, sched.alloc) do
# not name their scheduler, so the KV invariant cannot tell whose blocks a step read: not checked (a construction
# fact of these scenarios; a deployment has one scheduler per engine core, vLLM's own tests build them in turn).
TWO_SCHEDS = [KV_INVARIANT]


def _reused_ids(fault: bool) -> Callable[[], Scenario]:
    """Two P/D scheduler pairs in one process (as vLLM's own unit tests build them), with
    different KV layouts (block size 16 vs 32) and the SAME request ids on both pairs.
    Pair 1 runs a block-aligned prompt (the pre-fix P rule applies to it with ``fault``);
    pair 2 runs a prompt whose lookahead fits its last block."""
    def build() -> Scenario:
        pd = _pd()
        rec = pd.new_recorder()
        c1 = pd.PDConfig(spec_method="eagle", num_spec_tokens=1, block_size=16)
        c2 = pd.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=32)
        p1, p2 = pd.make_pair(c1, rec), pd.make_pair(c2, rec)
        r1 = pd.run_pd_request(c1, 32, faults=("old_p_block_rule",) if fault else (), pair=p1,
                               req_ids=("id-1", "id-1"))
        r2 = pd.run_pd_request(c2, 40, pair=p2, req_ids=("id-1", "id-1"))
        expected = [LOOKAHEAD_MISALIGNMENT] if _misaligned(r1, 16) or _misaligned(r2, 32) else []
        if fault:
            assert expected and not _misaligned(r2, 32), "oracle: only pair 1's transfer is shifted"
        seen: set[int] = set()
        events = []
        for e in list(p1.setup_events) + list(p2.setup_events) + r1.events + r2.events:
            if id(e) not in seen:
                seen.add(id(e))
                events.append(e)
        events.sort(key=lambda e: e["t"])
        return Scenario("", "", events, expected, {
            "real": [REAL_SCHED + " (two P/D pairs in one process)"], "simulated": [SIM_NIXL],
            "faults": ["old_p_block_rule on pair 1 only (pre-fix rule of vLLM PR #44151)"] if fault else [],
            "facts": {"pair1": {"p_reported": r1.p_reported, "trim_remote": r1.trim_remote, "block_size": 16},
                      "pair2": {"p_reported": r2.p_reported, "trim_remote": r2.trim_remote, "block_size": 32}},
        }, _unrecorded() + TWO_SCHEDS)
    return build


def _two_p_two_d(fault: bool) -> Callable[[], Scenario]:
    """2P2D in one process: prefill engines P1, P2 and decode engines D1, D2 (equal configs,
    distinct engine ids); each P sends one block-aligned request to each D (4 transfers, the
    same prompt length everywhere). With ``fault`` only P2 runs the pre-fix rule: exactly the
    two transfers from P2 are shifted, whichever D received them."""
    def build() -> Scenario:
        pd = _pd()
        rec = pd.new_recorder()
        c1 = pd.PDConfig(spec_method="eagle", num_spec_tokens=1, block_size=16, engine_tag="1")
        c2 = pd.PDConfig(spec_method="eagle", num_spec_tokens=1, block_size=16, engine_tag="2")
        a, b = pd.make_pair(c1, rec), pd.make_pair(c2, rec)
        runs = {}
        for pn, p_pair in (("P1", a), ("P2", b)):
            for dn, d_pair in (("D1", a), ("D2", b)):
                pair = pd.PDPair(p_pair.cfg, p_pair.p, d_pair.d, rec, [])
                bad = fault and pn == "P2"
                runs[(pn, dn)] = pd.run_pd_request(p_pair.cfg, 32, faults=("old_p_block_rule",) if bad else (),
                                                   pair=pair)
        shifted = sorted(f"{pn}->{dn}" for (pn, dn), r in runs.items() if _misaligned(r, 16))
        if fault:
            assert shifted == ["P2->D1", "P2->D2"], f"oracle: only P2's transfers are shifted, got {shifted}"
        else:
            assert not shifted
        seen: set[int] = set()
        events = []
        for e in list(a.setup_events) + list(b.setup_events) + [e for r in runs.values() for e in r.events]:
            if id(e) not in seen:
                seen.add(id(e))
                events.append(e)
        events.sort(key=lambda e: e["t"])
        return Scenario("", "", events, [LOOKAHEAD_MISALIGNMENT] if shifted else [], {
            "real": [REAL_SCHED + " (2 prefill + 2 decode engines in one process, each P to each D)"],
            "simulated": [SIM_NIXL],
            "faults": ["old_p_block_rule on P2 only (pre-fix rule of vLLM PR #44151)"] if fault else [],
            "facts": {"shifted": shifted,
                      "p_requests_shifted": sorted(r.p_req for (pn, dn), r in runs.items() if f"{pn}->{dn}" in shifted),
                      "d_requests_shifted": sorted(r.d_req for (pn, dn), r in runs.items() if f"{pn}->{dn}" in shifted)},
        }, _unrecorded() + TWO_SCHEDS)
    return build


def _merge(a: list[dict], b: list[dict]) -> list[dict]:
    return sorted(list(a) + list(b), key=lambda e: e["t"])
