"""Per-class coverage (pdtrace.detectors.coverage) and `check`'s exit code 4 on hand-built
traces: hook errors, dropped events, missing events, configuration rules, model runners.
The real-vLLM cases (scheduler / NIXL hooks that raise during a real P/D run) are corpus
scenarios (tests/test_corpus.py)."""

from __future__ import annotations

import json
import pathlib
import sys

from typer.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import eventlib as E  # noqa: E402

from pdtrace.cli import app  # noqa: E402
from pdtrace.detectors import ALL_KINDS, LOOKAHEAD_MISALIGNMENT, STALE_ACCEPTED_COUNT_READ  # noqa: E402
from pdtrace.detectors.coverage import CHECKED, NOT_APPLICABLE, NOT_CHECKED, coverage  # noqa: E402
from pdtrace.errors import EXIT_NOT_CHECKED  # noqa: E402
from pdtrace.tracefile.trace import load, make_footer  # noqa: E402

runner = CliRunner()
META, WINDOW = "connector-metadata-cleared-before-drafter", "drafter-window-outside-allocation"
KV = "kv-load-failure-recovery"


def _full(b=None, **kw):
    b = E.lookahead_scenario(b, prompt_len=16, lookahead=1, fixed=True, steps=True, **kw)
    E.metadata_scenario(b, fixed=True)
    E.window_scenario(b, fixed=True)
    return b


def _status(events, footer=None):
    return {k: c.status for k, c in coverage(events, {}, footer).items()}


def test_full_trace_is_checked_or_not_applicable():
    st = _status(_full().events)
    assert st == {LOOKAHEAD_MISALIGNMENT: CHECKED, META: CHECKED, WINDOW: CHECKED,
                  STALE_ACCEPTED_COUNT_READ: NOT_APPLICABLE, KV: CHECKED, "kv-never-crossed": CHECKED,
                  "kv-invariant": CHECKED}


def test_hook_error_makes_its_classes_not_checked():
    b = _full()
    b.add("hook.error", inst="D", role="engine-core", hook="nixl.remote_alloc", error="KeyError: 'remote_block_ids'")
    cov = coverage(b.events)
    c = cov[LOOKAHEAD_MISALIGNMENT]
    assert c.status == NOT_CHECKED and c.hook_errors == {"nixl.remote_alloc": 1}
    assert "hook nixl.remote_alloc raised 1 error(s) (first: KeyError: 'remote_block_ids')" in c.reason
    assert cov[META].status == cov[WINDOW].status == CHECKED  # other classes' hooks were fine


def test_footer_hook_errors_count_without_events():
    b = _full()
    foot = make_footer(b.events)
    foot["hook_errors"] = {"connector_metadata.has": 7}  # only the count survived (e.g. >5 per hook)
    cov = coverage(b.events, {}, foot)
    assert cov[META].status == NOT_CHECKED and "hook connector_metadata.has raised 7 error(s)" in cov[META].reason
    assert cov[LOOKAHEAD_MISALIGNMENT].status == CHECKED


def test_dropped_events_in_a_feeding_process():
    b = _full()
    d_engine = next(e["pid"] for e in b.events if e["ev"] == "nixl.remote_alloc")
    b.add("proc.exit", inst="D", role="engine-core", pid=d_engine, events=10, dropped=3, hook_errors={})
    st = _status(b.events)
    assert st[LOOKAHEAD_MISALIGNMENT] == NOT_CHECKED and st[META] == CHECKED


def test_v2_runner_stale_read_needs_acc_device(tmp_path):
    """A worker that built model runner V2 (``runner`` event, hooks/runner.py): the phase and
    window classes are hooked there too (hooks/spec_v2.py), so their events decide as on V1;
    the stale-read class on a hybrid model is not checked until that worker's ``acc.device``
    (hooks/states_v2.py) says the counts stay on the device, then it does not apply there."""
    b = _full()
    b.events[0]["group_kinds"] = ["FullAttentionSpec", "MambaSpec"]  # hybrid: the copy path would apply
    b.events[0]["block_sizes"] = [16, 16]
    before = _status(b.events)
    assert before[META] == before[WINDOW] == CHECKED and before[STALE_ACCEPTED_COUNT_READ] == NOT_CHECKED
    b.add("runner", inst="D", runner="v2", cls="vllm.v1.worker.gpu.model_runner.GPUModelRunner")
    cov = coverage(b.events)
    assert {k: c.status for k, c in cov.items()} == before
    c = cov[STALE_ACCEPTED_COUNT_READ]
    assert c.reason == ("model runner V2 ran (D pid 210) without the acc.device event that rules this class out "
                        "there (pid 210)"), c.reason
    path = b.write(tmp_path / "v2.jsonl")
    r = runner.invoke(app, ["check", path, "--format", "json"], catch_exceptions=False)
    doc = json.loads(r.output)
    assert r.exit_code == EXIT_NOT_CHECKED and doc["findings"] == []
    assert doc["summary"]["not_checked"] == [STALE_ACCEPTED_COUNT_READ]
    b.add("acc.device", inst="D", holder="vllm.v1.worker.gpu.model_states.mamba_hybrid.MambaHybridModelState",
          attr="num_accepted_tokens_gpu", device="cuda:0", keyed_by="slot", cpu_copy=False, runner="v2")
    c = coverage(b.events)[STALE_ACCEPTED_COUNT_READ]
    assert c.status == NOT_APPLICABLE and c.reason.startswith("model runner V2 keeps the accepted counts on the device")
    path = b.write(tmp_path / "v2-acc.jsonl")
    r = runner.invoke(app, ["check", path], catch_exceptions=False)
    assert r.exit_code == 0 and "does not apply: model runner V2 keeps the accepted counts" in r.output
    # beside a V1 worker the class is still decided on the V1 worker's events
    b.add("runner", inst="P", runner="v1", cls="vllm.v1.worker.gpu_model_runner.GPUModelRunner")
    c = coverage(b.events)[STALE_ACCEPTED_COUNT_READ]
    assert c.status == NOT_CHECKED and c.reason.startswith("the trace has no d2h.issue or acc.read")
    E.stale_read_scenario(b)
    c = coverage(b.events)[STALE_ACCEPTED_COUNT_READ]
    assert c.status == CHECKED and c.reason.startswith("does not apply on model runner V2: "), c.reason


def test_v2_hook_error_and_missing_acc_device_per_worker():
    """A failing V2 hook makes its classes not checked; each V2 worker needs its own acc.device."""
    b = _full()
    b.add("hook.error", inst="P", hook="spec_v2.propose.DFlashSpeculator", error="RuntimeError: boom")
    st = _status(b.events)
    assert st[META] == st[WINDOW] == NOT_CHECKED and st[LOOKAHEAD_MISALIGNMENT] == CHECKED
    b = E.EventBuilder()
    b.config("P", num_spec_tokens=3, spec_method="eagle", lookahead=3, group_kinds=["FullAttentionSpec", "MambaSpec"],
             block_sizes=[16, 16])
    for pid in (210, 211):
        b.add("runner", inst="D", pid=pid, runner="v2", cls="vllm.v1.worker.gpu.model_runner.GPUModelRunner")
    b.add("acc.device", inst="D", pid=210, holder="X", attr="num_accepted_tokens_gpu", device="cuda:0",
          keyed_by="slot", cpu_copy=False)
    c = coverage(b.events)[STALE_ACCEPTED_COUNT_READ]
    assert c.status == NOT_CHECKED and c.reason.endswith("(pid 211)"), c.reason


def test_v2_runner_without_spec_decode_does_not_apply():
    """The configuration still rules a class out on V2: no speculative decoding, nothing to check."""
    b = E.EventBuilder()
    b.config("P", num_spec_tokens=0, spec_method="", lookahead=0)
    b.add("runner", inst="P", runner="v2", cls="vllm.v1.worker.gpu.model_runner.GPUModelRunner")
    # (the KV invariant holds for any KV cache: no configuration rules it out; with no step, nothing was read)
    st = _status(b.events)
    assert {v for k, v in st.items() if k != "kv-invariant"} == {NOT_APPLICABLE} and st["kv-invariant"] == NOT_CHECKED


def test_runner_table_says_does_not_apply(monkeypatch):
    """The ``runners`` map (a runner on which a class cannot occur, with no event needed) still
    works as data; no class uses it today (V2's stale-read verdict waits for acc.device: na_when)."""
    from pdtrace.detectors import coverage as cov_mod

    spec = cov_mod.CLASSES[STALE_ACCEPTED_COUNT_READ]
    monkeypatch.setitem(cov_mod.CLASSES, STALE_ACCEPTED_COUNT_READ,
                        cov_mod.dataclasses.replace(spec, runners={"v3": "no copy on v3"}, na_when={}))
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, fixed=True)
    b.events[0]["group_kinds"] = ["FullAttentionSpec", "MambaSpec"]
    b.events[0]["block_sizes"] = [16, 16]
    b.add("runner", inst="D", runner="v3", cls="X")
    c = coverage(b.events)[STALE_ACCEPTED_COUNT_READ]
    assert c.status == NOT_APPLICABLE and c.reason == "no copy on v3"
    b.add("runner", inst="P", runner="v1", cls="Y")  # one worker on V1: no longer true of the whole trace
    assert coverage(b.events)[STALE_ACCEPTED_COUNT_READ].status == NOT_CHECKED


def test_config_rules_need_every_scheduler():
    b = E.EventBuilder()
    b.config("P", num_spec_tokens=0, spec_method="", lookahead=0)
    b.config("D", num_spec_tokens=0, spec_method="", lookahead=0)
    st = _status(b.events)
    assert {v for k, v in st.items() if k not in (KV, "kv-never-crossed", "kv-invariant")} == {NOT_APPLICABLE}
    # D loads KV whatever the spec config; this synthetic trace has no hooks.status saying the
    # KV-load hooks were applied
    assert st[KV] == NOT_CHECKED
    assert st["kv-never-crossed"] == CHECKED  # D loads KV: what it loaded is in its scheduler's own events
    E.kv_load_hooks(b)
    assert _status(b.events)[KV] == CHECKED
    b2 = E.EventBuilder()
    b2.config("P", num_spec_tokens=0, spec_method="", lookahead=0)  # P alone loads nothing
    assert _status(b2.events)[KV] == NOT_APPLICABLE == _status(b2.events)["kv-never-crossed"]
    b.config("PD", num_spec_tokens=3, spec_method="eagle3")  # one scheduler with spec decode
    st = _status(b.events)
    assert st[WINDOW] == NOT_CHECKED and st[LOOKAHEAD_MISALIGNMENT] == NOT_CHECKED


def test_scheduler_hook_failure_blocks_config_rules():
    b = E.EventBuilder()
    b.config("P", num_spec_tokens=0, spec_method="", lookahead=0)
    b.add("hook.error", inst="D", role="engine-core", hook="scheduler.init", error="AttributeError: x")
    assert set(_status(b.events).values()) == {NOT_CHECKED}  # D's config is unknown


def test_check_exit_4_and_formats_carry_coverage(tmp_path):
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, fixed=True)
    b.add("hook.error", inst="P", role="engine-core", hook="scheduler.init", error="TypeError: y")
    path = b.write(tmp_path / "t.jsonl")
    r = runner.invoke(app, ["check", path], catch_exceptions=False)
    assert r.exit_code == EXIT_NOT_CHECKED == 4
    assert "lookahead-block-misalignment" in r.output and "not checked: hook scheduler.init raised 1" in r.output
    r = runner.invoke(app, ["check", path, "--format", "json"], catch_exceptions=False)
    doc = json.loads(r.output)
    assert r.exit_code == 4 and set(doc["coverage"]) == set(ALL_KINDS)
    assert doc["summary"]["not_checked"] == list(ALL_KINDS)  # P's config is unknown: nothing is ruled out
    assert doc["coverage"][LOOKAHEAD_MISALIGNMENT]["hook_errors"] == {"scheduler.init": 1}
    r = runner.invoke(app, ["check", path, "--format", "markdown"], catch_exceptions=False)
    assert r.exit_code == 4 and "### Coverage" in r.output
    assert f"| `{LOOKAHEAD_MISALIGNMENT}` | not checked: hook scheduler.init raised 1 error(s)" in r.output
    # --only narrows coverage to the classes asked for
    r = runner.invoke(app, ["check", path, "--format", "json", "--only", STALE_ACCEPTED_COUNT_READ],
                      catch_exceptions=False)
    doc = json.loads(r.output)
    assert list(doc["coverage"]) == [STALE_ACCEPTED_COUNT_READ] and r.exit_code == 4


def test_findings_still_exit_1_when_classes_are_not_checked(tmp_path):
    b = E.lookahead_scenario(prompt_len=16, lookahead=1)  # buggy, no worker events
    path = b.write(tmp_path / "b.jsonl")
    r = runner.invoke(app, ["check", path], catch_exceptions=False)
    assert r.exit_code == 1 and "1 finding(s)" in r.output and "3 bug class(es) not checked" in r.output
    tr = load(path)
    assert coverage(tr.events, tr.header, tr.footer)[LOOKAHEAD_MISALIGNMENT].status == CHECKED


def test_class_blind_when_its_hook_module_failed_to_import():
    """A hook module that does not import registers nothing: doctor must not call the classes it feeds
    "recorded" (it did: the lookahead class read "recorded" with every nixl hook missing)."""
    from pdtrace import hooks
    from pdtrace.commands.doctor_coverage import class_coverage

    hooks.load_subsystems()
    rows = [{"hook": s.name, "status": "ok"} for s in hooks.REGISTRY.values() if not s.name.startswith("nixl.")]
    rows.append({"hook": "nixl.*", "subsystem": "nixl", "status": "skipped"})
    by_class = {c["class"]: c for c in class_coverage(rows)}
    look = by_class["lookahead-block-misalignment"]
    assert look["v1"].startswith("not checked") and "nixl.*" in look["v1"]
    assert by_class["stale-accepted-count-read"]["v1"].startswith("recorded")


def test_a_cut_trace_without_the_hooks_status_says_so_not_recorded_without_the_hook(tmp_path):
    """Issue 39 (a new user's pass): a recording cut off (no footer) whose hooks.status line was damaged read
    as "recorded without the hook(s) kv_load.invalid_blocks ... recorded before pdtrace had this class", which
    points the wrong way. Trace: the bundled KV-load sample with its footer dropped and its hooks.status line
    cut in half."""
    src = pathlib.Path(__file__).parent.parent / "sample_traces" / "kv_load_async_rollback_fixed.jsonl"
    lines = [ln for ln in src.read_text().splitlines() if '"ev":"trace.footer"' not in ln]
    cut = [ln[: len(ln) // 2] if '"ev":"hooks.status"' in ln else ln for ln in lines]
    assert cut != lines
    bad = tmp_path / "cut.jsonl"
    bad.write_text("\n".join(cut) + "\n")
    r = runner.invoke(app, ["check", "--lenient", "--format", "json", str(bad)])
    reason = json.loads(r.stdout)["coverage"][KV]["reason"]
    assert r.exit_code == EXIT_NOT_CHECKED
    assert reason.startswith("the trace is incomplete (") and "may be among what was lost" in reason
    assert "recorded before pdtrace had this class" not in reason
    # the whole trace, recorded with the hook: checked; a trace really recorded without it keeps its words
    whole = runner.invoke(app, ["check", "--format", "json", str(src)])
    assert json.loads(whole.stdout)["coverage"][KV]["status"] == CHECKED
    old = pathlib.Path(__file__).parent.parent / "sample_traces" / "live_cpu_pd_eagle.jsonl"
    r = runner.invoke(app, ["check", "--format", "json", str(old)])
    assert "recorded before pdtrace had this class" in json.loads(r.stdout)["coverage"][KV]["reason"]


def test_processes_without_hooks_status_are_named():
    """A process that started (proc.start) but whose hooks.status is not in the trace may have applied the
    hook: the reason names it instead of saying the trace was recorded without the hook."""
    evs = [{"ev": "proc.start", "pid": 7, "t": 1, "w": 1, "role": "engine-core", "id": 0},
           {"ev": "sched.config", "pid": 7, "t": 2, "w": 2, "inst": "D", "kv_role": "kv_consumer",
            "block_sizes": [16], "num_spec_tokens": 0, "id": 1},
           {"ev": "kvload.handled", "pid": 7, "t": 3, "w": 3, "inst": "D", "req": "r", "step": 1, "id": 2}]
    cov = coverage(evs, {}, None)[KV]
    assert cov.status == NOT_CHECKED
    assert "1 process(es) have no hooks.status event (pid 7" in cov.reason, cov.reason
