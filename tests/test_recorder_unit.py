"""Recorder and hook-registry behaviour in one process (no vLLM)."""

import sys
import types

import pytest

from pdtrace import hooks, recorder
from pdtrace.recorder import Recorder


def test_bounded_queue_counts_drops():
    rec = Recorder(sink=lambda batch: None, threaded=False, max_queue=10)
    for i in range(25):
        rec.emit("mark", label=str(i))
    assert rec.dropped == 15 and len(rec._q) == 10
    rec.flush()
    assert len(rec._q) == 0


def test_events_carry_common_fields_and_overrides():
    rec = Recorder.in_memory(role="engine-core", inst="P")
    rec.step = 7
    rec.emit("mark", label="a", req="r1")
    rec.emit("mark", label="b", inst="D", step=3)  # a hook may name another instance explicitly
    rec.flush()
    a, b = rec.events
    assert (a["role"], a["inst"], a["step"], a["req"]) == ("engine-core", "P", 7, "r1")
    assert (b["inst"], b["step"]) == ("D", 3)
    assert a["w"] - a["t"] == b["w"] - b["t"]  # one wall anchor per process


@pytest.fixture
def fake_target():
    mod = types.ModuleType("pdtrace_fake_target")

    class Engine:
        def step(self, n, scale=1):
            return n * scale

    mod.Engine = Engine
    sys.modules[mod.__name__] = mod
    yield mod
    sys.modules.pop(mod.__name__, None)


def test_a_hook_that_raises_is_counted_and_the_result_is_unchanged(fake_target):
    def boom(rec, result, self, n, scale=1):
        raise RuntimeError("hook bug")

    spec = hooks.register("test.boom", fake_target.__name__, "Engine.step", ("n", "scale"), hooks.after("test.boom", boom))
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        hooks._apply(spec, fake_target)
        assert spec.status == "applied"
        assert fake_target.Engine().step(6, scale=7) == 42  # vLLM's result, untouched
        assert fake_target.Engine().step(2) == 2
        assert rec.hook_errors == {"test.boom": 2}
        rec.flush()
        errs = [e for e in rec.events if e["ev"] == "hook.error"]
        assert errs and "RuntimeError: hook bug" in errs[0]["error"]
    finally:
        recorder.set_current(prev)
        setattr(spec.owner, "step", spec.original)
        hooks.REGISTRY.pop("test.boom")


def test_signature_drift_is_skipped_with_a_reason(fake_target):
    spec = hooks.register("test.drift", fake_target.__name__, "Engine.step", ("num_tokens",),
                          hooks.after("test.drift", lambda *a, **k: None))
    try:
        hooks._apply(spec, fake_target)
        assert spec.status == "skipped"
        assert "signature drift" in spec.reason and "num_tokens" in spec.reason
        assert not getattr(fake_target.Engine.step, "__pdtrace_hook__", None)
        status, why = hooks.check(spec)
        assert status == "skipped" and "signature drift" in why
    finally:
        hooks.REGISTRY.pop("test.drift")


def test_missing_target_is_skipped(fake_target):
    spec = hooks.register("test.missing", fake_target.__name__, "Engine.gone", (), hooks.after("test.missing", lambda *a: None))
    try:
        assert hooks.check(spec) == ("skipped", "missing target: pdtrace_fake_target.Engine.gone does not exist")
    finally:
        hooks.REGISTRY.pop("test.missing")


def test_post_import_hook_patches_a_module_imported_later(tmp_path, monkeypatch):
    (tmp_path / "pdtrace_late_mod.py").write_text("class K:\n    def f(self, x):\n        return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    spec = hooks.register("test.late", "pdtrace_late_mod", "K.f", ("x",),
                          hooks.after("test.late", lambda rec, result, self, x: seen.append((x, result))))
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        hooks._armed.setdefault("pdtrace_late_mod", []).append(spec)
        finder = hooks._PostImportFinder()
        sys.meta_path.insert(0, finder)
        import pdtrace_late_mod  # noqa: F401  (the import applies the hook)

        assert spec.status == "applied"
        assert pdtrace_late_mod.K().f(1) == 2
        assert seen == [(1, 2)]
    finally:
        recorder.set_current(prev)
        sys.meta_path.remove(finder)
        hooks._armed.pop("pdtrace_late_mod", None)
        hooks.REGISTRY.pop("test.late")
        sys.modules.pop("pdtrace_late_mod", None)
