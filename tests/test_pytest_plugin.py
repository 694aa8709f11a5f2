"""`pytest --pdtrace` (pdtrace/testing/pytest_plugin.py, issue 37) on an inner pytest run in a
subprocess (pytest's own ``pytester``). The inner tests drive real vLLM code: P's and D's real
``Scheduler`` with the NIXL connector's scheduler side (``pdtrace.testing.pd_harness``, handed the
plugin's own recorder so the events land in the test's trace), clean, and with the labelled
pre-fix P block rule (``old_p_block_rule``, a fault this project puts back). The oracle for which
inner tests must fail is that fault, never the detector: the tests that apply it, and only those.
vLLM's own kv_connector tests under the plugin: tests/test_upstream_vllm.py."""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("vllm")

pytest_plugins = ["pytester"]

INNER = '''
import pytest
from pdtrace.record import recorder
from pdtrace.testing.pd_harness import PDConfig, make_pair, run_pd_request

def _run(faults=()):
    pair = make_pair(PDConfig(spec_method="eagle", num_spec_tokens=1), recorder.get())
    run_pd_request(pair=pair, prompt_len=32, faults=faults)

def test_clean():
    _run()

def test_fault():
    _run(("old_p_block_rule",))

@pytest.mark.pdtrace_expect("lookahead-block-misalignment")
def test_fault_expected():
    _run(("old_p_block_rule",))

@pytest.mark.pdtrace_expect("lookahead-block-misalignment")
def test_expected_but_clean():
    _run()

@pytest.mark.pdtrace_skip
def test_fault_not_recorded():
    _run(("old_p_block_rule",))

def test_plain_python():
    assert 1 + 1 == 2

def _forked():
    from pdtrace.record import recorder
    r = recorder.get()
    r is None or r.emit("mark", label="forked")

def test_children():
    import multiprocessing, subprocess, sys
    subprocess.run([sys.executable, "-c", "from pdtrace.record import recorder; r = recorder.get(); "
                    "r is None or r.emit('mark', label='spawned')"], check=True)
    p = multiprocessing.get_context("fork").Process(target=_forked)
    p.start()
    p.join()
    assert p.exitcode == 0
'''


VLLM_CACHE_ROOT = os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")  # (before pytester's HOME)


@pytest.fixture(autouse=True)
def _vllm_cache_kept(monkeypatch):
    """pytester gives each inner run a HOME of its own, so vLLM's model-info cache (~/.cache/vllm/modelinfos) is
    empty there and vLLM inspects the target and drafter classes in a `python -m vllm.model_executor.models.registry`
    subprocess each (~6 s apiece on 2 cores, every inner run). The inner runs share the outer one's cache root."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", VLLM_CACHE_ROOT)


def _run(pytester, *args):
    pytester.makepyfile(test_inner=INNER)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *args)


def test_off_the_plugin_changes_nothing(pytester):
    r = _run(pytester)
    r.assert_outcomes(passed=7)
    out = r.stdout.str()
    # none of the plugin's own output (its summary section, its per-test lines); paths in other tools' warnings may
    # name a clone called pdtrace (a fresh clone's venv path did: the test failed for a new user, 2026-11-29)
    assert not re.search(r"^=+ pdtrace =+$", out, re.M)  # the summary section
    assert "test(s) recorded" not in out and "findings per class" not in out and "pdtrace:" not in out


def test_on_each_test_its_trace_and_the_faults_fail(pytester, tmp_path):
    d = tmp_path / "traces"
    r = _run(pytester, "--pdtrace", f"--pdtrace-dir={d}", "--pdtrace-keep=all", "-rA")
    out = r.stdout.str()
    # exactly the tests that put the fault back fail, and the one that expected a finding it did not get
    r.assert_outcomes(passed=5, failed=2)
    for name in ("test_fault ", "test_expected_but_clean"):
        assert f"FAILED test_inner.py::{name.strip()}" in out, out
    assert "lookahead-block-misalignment" in out and "trace: " in out
    assert "expected findings of ['lookahead-block-misalignment'], found none" in out
    traces = sorted(p.name for p in d.glob("*.jsonl"))
    assert traces == sorted(f"test_inner.py_{n}.jsonl" for n in ("test_clean", "test_fault", "test_fault_expected",
                                                                   "test_expected_but_clean", "test_plain_python",
                                                                   "test_children"))
    assert not list(d.glob("*.shards"))
    head = json.loads((d / "test_inner.py_test_clean.jsonl").read_text().splitlines()[0])
    assert head["ev"] == "trace.header"
    # a child the test spawned and one it forked record into the test's trace, each with its own pid
    evs = [json.loads(x) for x in (d / "test_inner.py_test_children.jsonl").read_text().splitlines()]
    marks = {e["label"]: e["pid"] for e in evs if e["ev"] == "mark"}
    assert {"pytest", "spawned", "forked"} <= set(marks) and len({marks[k] for k in ("pytest", "spawned", "forked")}) == 3
    assert "6 test(s) recorded" in out and "findings per class: lookahead-block-misalignment" in out


def test_the_ini_turns_it_on_keeps_failed_only_never_fails_and_registers_the_markers(pytester, tmp_path):
    """The ini turns the plugin on and sets its options (one inner run for both: each costs a vLLM import):
    ``pdtrace_fail_on = never`` fails no test for a finding (pdtrace_expect still judges its own test), and the
    default keep (failed) leaves only the failing test's trace; the markers are registered (an unknown one is an
    error here)."""
    d = tmp_path / "t"
    pytester.makeini(f"[pytest]\npdtrace = true\npdtrace_fail_on = never\npdtrace_dir = {d}\n")
    r = _run(pytester, "-W", "error::pytest.PytestUnknownMarkWarning")
    r.assert_outcomes(passed=6, failed=1)  # pdtrace_expect still judges its test
    assert sorted(p.name for p in d.glob("*.jsonl")) == ["test_inner.py_test_expected_but_clean.jsonl"]
    h = pytester.runpytest_subprocess("--help")
    assert "--pdtrace-fail-on" in h.stdout.str() and "--pdtrace-keep" in h.stdout.str()
    m = pytester.runpytest_subprocess("--markers")
    assert "pdtrace_expect(*kinds)" in m.stdout.str() and "pdtrace_skip" in m.stdout.str()


def test_no_pdtrace_unloads_it(pytester):
    r = _run(pytester, "-p", "no:pdtrace", "--pdtrace")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and "unrecognized arguments: --pdtrace" in r.stderr.str()


def test_under_xdist_each_worker_records_its_tests(pytester, tmp_path):
    """pytest-xdist, two workers: every test recorded once, in its worker's directory, the faults
    failing as in one process; the summary, gathered by the controller from the workers' reports."""
    pytest.importorskip("xdist")  # (a test dependency: pyproject's [test] extra)
    d = tmp_path / "x"
    r = _run(pytester, "-n", "2", "--pdtrace", f"--pdtrace-dir={d}", "--pdtrace-keep=all")
    r.assert_outcomes(passed=5, failed=2)
    per_worker = {p.parent.name for p in d.glob("*/*.jsonl")}
    assert per_worker <= {"gw0", "gw1"} and per_worker
    assert len(list(d.glob("*/*.jsonl"))) == 6
    assert "6 test(s) recorded" in r.stdout.str()
