"""`pdtrace doctor` on the installed vLLM, and `pdtrace repro` end to end (trace -> pytest file
-> run it on real vLLM: passes on fixed code, fails with the fault the trace shows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_doctor_json_lists_every_subsystem(pd_harness, capsys):
    from pdtrace import hooks
    from pdtrace.commands import doctor

    rc = doctor.run(json_out=True)
    data = json.loads(capsys.readouterr().out)
    rows = {r["hook"]: r for r in data["hooks"]}
    import vllm

    assert data["versions"]["vllm"] == vllm.__version__ and vllm.__version__.split("+")[0] in ("0.32.0", "0.33.0")
    assert data["versions"]["torch"].startswith("2.13")
    subs = {r["subsystem"] for r in data["hooks"]}
    assert subs == set(hooks.SUBSYSTEMS)
    for name in ("scheduler.schedule", "scheduler.allocate_slots", "nixl.request_finished", "nixl.trim",
                 "nixl.remote_alloc", "nixl.read", "nixl.transfer_results"):
        assert rows[name]["status"] == "ok", rows[name]
    # the one-file layout of 0.19.x is another form of the same hooks (HookSpec.layouts), never a
    # hook of its own: here each takes this release's target
    assert not any(n.endswith("_old") for n in rows)
    assert rows["nixl.trim"]["target"].endswith(":NixlBaseConnectorWorker._apply_prefix_caching")
    failed = [r for r in data["hooks"] if r["status"] != "ok" and not r["optional"]]
    assert data["failed"] == len(failed)
    assert rc == (1 if failed else 0)


def test_doctor_coverage_per_class_and_runner(pd_harness, capsys, monkeypatch):
    """Per bug class on the installed vLLM 0.32.0: the hooks feeding it and whether they fire
    under model runner V1 / V2; vLLM's default runner from its own code (VllmConfig.
    use_v2_model_runner reads VLLM_USE_V2_MODEL_RUNNER and HAS_TRITON; no VllmConfig built)."""
    import importlib.util

    from pdtrace.commands import doctor
    from pdtrace.detectors import ALL_KINDS, LOOKAHEAD_MISALIGNMENT

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    doctor.run(json_out=True)
    data = json.loads(capsys.readouterr().out)
    cov = {c["class"]: c for c in data["coverage"]}
    assert set(cov) == set(ALL_KINDS)
    look = cov[LOOKAHEAD_MISALIGNMENT]
    assert "nixl.remote_alloc" in look["hooks"] and look["runner_hooks"] == []
    assert look["v1"].startswith("recorded") and look["v2"].startswith("recorded")
    for kind, runner_hook, v2_hook in (
            ("connector-metadata-cleared-before-drafter", "connector_metadata.drafter_propose",
             "spec_v2.propose.TargetDependentARSpeculator"),
            ("drafter-window-outside-allocation", "accepted_counts.window", "spec_v2.propose.DFlashSpeculator"),
            ("stale-accepted-count-read", "accepted_counts.read", "states_v2.acc_device")):
        c = cov[kind]
        h = c["hooks"][runner_hook]
        assert runner_hook in c["runner_hooks"] and h["status"] == "ok" and h["runner"] == "v1"
        assert h["v1"] is True and h["v2"] is False
        assert c["v1"].startswith("recorded (") and runner_hook in c["v1"] and v2_hook not in c["v1"]
        h2 = c["hooks"][v2_hook]  # model runner V2's own hooks (hooks/spec_v2.py, states_v2.py)
        assert h2["status"] == "ok" and h2["runner"] == "v2" and h2["v2"] is True and h2["v1"] is False
        assert v2_hook in c["v2"] and runner_hook not in c["v2"]
    assert cov["connector-metadata-cleared-before-drafter"]["v2"].startswith("recorded (spec_v2.target_forward")
    assert cov["drafter-window-outside-allocation"]["v2"].startswith("recorded (spec_v2.propose.")
    assert cov["stale-accepted-count-read"]["v2"].startswith("does not apply where the trace has acc.device")
    # connector methods run under either runner (V2's ActiveKVConnector calls bind/clear too)
    bind = cov["connector-metadata-cleared-before-drafter"]["hooks"]["connector_metadata.bind"]
    assert bind["runner"] == "any" and bind["v1"] and bind["v2"]
    # record --kv-checksum (issue 60): its two hooks apply on this release's V1 runner; V2 has none
    ck = data["kv_checksum"]
    assert ck["v1"].startswith("can run (nixl.digest_layers, accepted_counts.settle") and ck["v2"].startswith("cannot")
    mr = data["model_runner"]
    assert mr["switch"] and mr["reads_env"] and mr["reads_triton"]
    import vllm

    # read off each release's VllmConfig._get_v2_model_runner_unsupported_features by hand:
    # 0.33.0 runs medusa and mlp_speculator on V2
    off = {"0.32.0": {"suffix", "medusa", "mlp_speculator", "custom_class"},
           "0.33.0": {"suffix", "custom_class"}}[vllm.__version__.split("+")[0]]
    assert off <= set(mr["v2_off_spec_methods"])
    assert "eagle" not in mr["v2_off_spec_methods"]
    assert mr["gpu_default"] == "v2" and mr["env_VLLM_USE_V2_MODEL_RUNNER"] is None
    triton = importlib.util.find_spec("triton") is not None
    assert mr["triton_here"] == triton and mr["here"] == ("v2" if triton else "v1")
    # the environment variable decides over Triton, as in vLLM's property
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert doctor.run(json_out=False) in (0, 1)
    out = capsys.readouterr().out
    assert "bug-class coverage on this vLLM" in out
    assert "default on a GPU host: V1 (VLLM_USE_V2_MODEL_RUNNER=0 is set)" in out
    assert "the trace's 'runner' event" in out


def test_doctor_json_keeps_stdout_json_when_imports_print(pd_harness, capsys, monkeypatch):
    """vLLM 0.30.0 printed INFO log lines on stdout when doctor imported it, before the JSON.
    Whatever is printed while doctor inspects the hooks now goes to stderr: stdout is one JSON
    document. (0.32.0 prints nothing there, so the test makes the import step print.)"""
    from pdtrace.commands import doctor

    real_rows = doctor._rows

    def noisy_rows():
        print("INFO 11-23 [__init__.py:239] Automatically detected platform cpu.")
        return real_rows()

    monkeypatch.setattr(doctor, "_rows", noisy_rows)
    doctor.run(json_out=True)
    cap = capsys.readouterr()
    data = json.loads(cap.out)
    assert data["hooks"] and "Automatically detected platform" in cap.err


def test_doctor_reports_signature_drift(pd_harness, capsys, monkeypatch):
    """A hook whose expected parameters no longer match is skipped with the reason, exit 1."""
    from pdtrace import hooks
    from pdtrace.commands import doctor

    hooks.load_subsystems()  # (run alone, nothing else has registered the hooks yet)
    spec = hooks.REGISTRY["scheduler.add_request"]
    monkeypatch.setattr(spec, "params", ("req",))
    rc = doctor.run(json_out=False)
    out = capsys.readouterr().out
    assert rc == 1
    line = [ln for ln in out.splitlines() if ln.strip().startswith("scheduler.add_request")][0]
    assert "SKIPPED" in line and "signature drift" in line and "(request" in line


def test_doctor_without_vllm(monkeypatch, capsys):
    import importlib.util

    from pdtrace.commands import doctor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    assert doctor.run(json_out=False) == 2
    assert "pdtrace[record]" in capsys.readouterr().err


def _pytest(path, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(path.parent))


def test_repro_p_block_rule(pd_harness, tmp_path):
    from pdtrace.commands import repro
    from pdtrace.tracefile.trace import load

    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 32, faults=("old_p_block_rule",))
    trace = tmp_path / "buggy.jsonl"
    pd_harness.write_scenario_trace(str(trace), r.events)
    s = repro.situation(load(str(trace)).events, r.d_req)
    assert s["p_req"] == r.p_req and s["prompt_len"] == 32 and s["block_sizes"] == [16]
    assert s["p_reported"] == r.p_reported and len(s["p_reported"][0]) == 3 and s["remote_num_tokens"] == 32
    assert repro.suspected_faults(s) == ["old_p_block_rule"]

    out = tmp_path / "test_repro_p.py"
    assert repro.run(trace, r.d_req, out, False) == 0
    text = out.read_text()
    assert "PDTRACE_REPRO_FAULTS=old_p_block_rule" in text and "block_size=16" in text

    fixed = _pytest(out, {"PDTRACE_REPRO_FAULTS": ""})
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    buggy = _pytest(out, {"PDTRACE_REPRO_FAULTS": "old_p_block_rule"})
    assert buggy.returncode == 1, buggy.stdout[-3000:]
    assert "FAILED" in buggy.stdout
    assert "test_p_reports_only_blocks_covering_computed_tokens" in buggy.stdout
    assert "test_d_block_i_maps_to_p_block_i" in buggy.stdout
    assert "test_lookahead_reserved_for_drafter" not in buggy.stdout.split("short test summary")[-1]


def test_repro_dflash_lookahead(pd_harness, tmp_path):
    from pdtrace.commands import repro
    from pdtrace.tracefile.trace import load

    cfg = pd_harness.PDConfig(spec_method="dflash", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 29, faults=("old_dflash_lookahead",))
    trace = tmp_path / "dflash.jsonl"
    pd_harness.write_scenario_trace(str(trace), r.events)
    s = repro.situation(load(str(trace)).events, r.p_req)
    assert s["spec_method"] == "dflash" and s["p_alloc_lookahead"] == 3
    assert repro.suspected_faults(s) == ["old_dflash_lookahead"]
    out = tmp_path / "test_repro_dflash.py"
    repro.run(trace, r.p_req, out, False)
    assert _pytest(out, {}).returncode == 0
    buggy = _pytest(out, {"PDTRACE_REPRO_FAULTS": "old_dflash_lookahead"})
    assert buggy.returncode == 1
    assert "test_lookahead_reserved_for_drafter" in buggy.stdout


def test_repro_unknown_request(pd_harness, tmp_path):
    from pdtrace.commands import repro
    from pdtrace.errors import PdtraceError

    r = pd_harness.run_pd_request(pd_harness.PDConfig(), 16)
    trace = tmp_path / "t.jsonl"
    pd_harness.write_scenario_trace(str(trace), r.events)
    with pytest.raises(PdtraceError, match="does not appear"):
        repro.run(trace, "nope", tmp_path / "x.py", False)


def test_repro_refuses_a_request_whose_findings_it_cannot_rebuild(tmp_path):
    """The stale-read sample's req-10-D has a stale-accepted-count-read finding (model-runner side):
    repro would write a scheduler-side test that passes, so it refuses and says why."""
    from pdtrace.commands import repro
    from pdtrace.errors import PdtraceError

    sample = os.path.join(os.path.dirname(__file__), "..", "sample_traces", "stale_read_rowmoves_buggy.jsonl")
    with pytest.raises(PdtraceError, match="stale-accepted-count-read, which repro cannot rebuild"):
        repro.run(sample, "req-10-D", tmp_path / "x.py", False)
    assert not (tmp_path / "x.py").exists()
