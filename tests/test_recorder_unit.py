"""Recorder and hook-registry behaviour in one process (no vLLM)."""

import sys
import types

import pytest

from pdtrace import hooks
from pdtrace.record import recorder
from pdtrace.record.recorder import Recorder


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
        hooks._armed.setdefault("pdtrace_late_mod", []).append((spec, spec.forms()[0]))
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


# --- shard frames (what a recording process writes) ----------------------------------------

class _Ids(recorder.Deferred):
    __slots__ = ("blocks",)

    def __init__(self, blocks):
        self.blocks = blocks

    def json(self):
        return [b * 10 for b in self.blocks]


def _shard_events(tmp_path, fill):
    from pdtrace.record.shards import read_shard

    rec = Recorder.to_shard_dir(str(tmp_path), threaded=False, role="engine-core", inst="P", rank=1)
    fill(rec)
    rec.flush()
    return rec, read_shard(rec.shard_path)


def test_shard_frames_round_trip_like_the_in_memory_sink(tmp_path):
    def fill(rec):
        rec.step = 4
        rec.emit("mark", label="a", req='r"1')
        rec.put("mark", None, 9, {"label": "b", "inst": "D", "nested": [[1, 2], []]})
        rec.put_deferred("mark", "r2", None, {"label": "c", "ids": _Ids([1, 2])}, ("ids",))

    rec, (events, problems) = _shard_events(tmp_path, fill)
    mem = Recorder.in_memory(role="engine-core", inst="P", rank=1)
    fill(mem)
    mem.flush()
    assert problems == []
    assert rec.shard_path.endswith(".pdshard")
    strip = [{k: v for k, v in e.items() if k not in ("t", "w", "pid")} for e in events]
    assert strip == [{k: v for k, v in e.items() if k not in ("t", "w", "pid")} for e in mem.events]
    assert events[2]["ids"] == [10, 20] and "\x00deferred" not in events[2]
    assert events[1]["inst"] == "D" and events[0]["inst"] == "P" and events[0]["rank"] == 1


def test_a_value_marshal_cannot_take_becomes_its_json_form(tmp_path):
    class Odd:
        def __repr__(self):
            return "<odd>"

    _, (events, problems) = _shard_events(tmp_path, lambda rec: rec.emit("mark", label="x", odd=Odd(), s={3, 1}))
    assert problems == [] and events[0]["odd"] == "<odd>" and events[0]["s"] == [1, 3]


def test_a_cut_last_frame_keeps_every_earlier_frame(tmp_path):
    from pdtrace.record.shards import read_shard

    rec = Recorder.to_shard_dir(str(tmp_path), threaded=False)
    rec.emit("mark", label="kept")
    rec.flush()
    rec.emit("mark", label="lost")
    rec.flush()
    data = open(rec.shard_path, "rb").read()
    open(rec.shard_path, "wb").write(data[:-5])  # SIGKILL mid-write
    events, problems = read_shard(rec.shard_path)
    assert [e["label"] for e in events] == ["kept"]
    assert len(problems) == 1 and "frame 2" in str(problems[0]) and "truncated" in str(problems[0])
    open(rec.shard_path, "wb").write(data[:3])
    events, problems = read_shard(rec.shard_path)
    assert events == [] and "truncated header" in str(problems[0])


# --- generated (signature-exact) wrappers --------------------------------------------------

def _target():
    class Manager:
        def allocate(self, request, n, extra=0, *, flag=False):
            if n < 0:
                raise ValueError("negative")
            return (request, n, extra, flag)

    return Manager


def test_generated_wrapper_keeps_signature_and_semantics():
    import inspect

    Manager = _target()
    seen = []
    orig = Manager.allocate
    w = hooks.after("t.alloc", lambda rec, result, self, request, n, extra=0, *a, **kw: seen.append((result, kw)))(orig)
    assert getattr(w, "__pdtrace_fast__", False) and inspect.signature(w) == inspect.signature(orig)
    Manager.allocate = w
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        m = Manager()
        assert m.allocate("r", 2, flag=True) == ("r", 2, 0, True)
        assert m.allocate(request="q", n=1, extra=5) == ("q", 1, 5, False)
        with pytest.raises(ValueError):  # the original's exception passes through untouched
            m.allocate("r", -1)
    finally:
        recorder.set_current(prev)
    assert seen == [(("r", 2, 0, True), {"flag": True}), (("q", 1, 5, False), {"flag": False})]


def test_generated_wrapper_skip_filter_and_fallbacks():
    Manager = _target()
    calls = []
    rec_fn = lambda rec, result, self, request, n, *a, **kw: calls.append(n)  # noqa: E731
    w = hooks.after("t.alloc", rec_fn, skip="n == 0 and not extra")(Manager.allocate)
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        w(Manager(), "r", 0)
        w(Manager(), "r", 0, 1)
        w(Manager(), "r", 3)
    finally:
        recorder.set_current(prev)
    assert calls == [0, 3]
    # a skip naming something the wrapper does not have is dropped (record filters itself)
    assert hooks.after("t.alloc", rec_fn, skip="undefined_name")(Manager.allocate).__pdtrace_fast__
    # a recorder whose parameters do not line up with the original's gets the generic wrapper
    bad = hooks.after("t.alloc", lambda rec, result, self, n, request: None)(Manager.allocate)
    assert not getattr(bad, "__pdtrace_fast__", False) and bad.__pdtrace_hook__ == "t.alloc"


def test_after_skip_names_give_the_expression_constants():
    """``after(skip_names=...)``: the expression may name the constants it returns (resolved
    when the target is patched); a name not starting ``_pdt_`` is not passed; when the
    function fails the expression is dropped and every call records."""
    Manager = _target()
    calls = []
    rec_fn = lambda rec, result, self, request, n, *a, **kw: calls.append(n)  # noqa: E731
    w = hooks.after("t.alloc", rec_fn, skip="n == _pdt_SKIP",
                    skip_names=lambda: {"_pdt_SKIP": 2, "other": 1})(Manager.allocate)
    assert w.__pdtrace_fast__

    def boom():
        raise ImportError("no vllm")

    w_bad = hooks.after("t.alloc", rec_fn, skip="n == _pdt_SKIP", skip_names=boom)(Manager.allocate)
    w_other = hooks.after("t.alloc", rec_fn, skip="n == other",
                          skip_names=lambda: {"other": 1})(Manager.allocate)
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        for fn in (w, w_bad, w_other):
            for n in (1, 2):
                fn(Manager(), "r", n)
    finally:
        recorder.set_current(prev)
    assert calls == [1, 1, 2, 1, 2] and rec.hook_errors == {}


def test_generated_wrapper_counts_recorder_errors():
    Manager = _target()

    def broken(rec, result, self, request, n, *a, **kw):
        raise RuntimeError("hook bug")

    w = hooks.after("t.broken", broken)(Manager.allocate)
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        assert w(Manager(), "r", 1) == ("r", 1, 0, False)
    finally:
        recorder.set_current(prev)
    assert rec.hook_errors == {"t.broken": 1}


@pytest.mark.parametrize("generated", [True, False])
def test_before_wrapper_records_first_and_contains_errors(generated):
    """``before``: the record runs before the original with its arguments; a recording error is
    counted and the original still runs; the original's exception passes through. Checked on
    the generated wrapper and on the generic one (a recorder whose parameters do not line up)."""
    Manager = _target()
    order = []

    def rec_fn(rec, self, request, n, *a, **kw):
        order.append(("record", request, n))
        if n == 7:
            raise RuntimeError("hook bug")

    def generic_fn(rec, self, n, request, *a, **kw):  # names out of line: the generic wrapper
        rec_fn(rec, self, n, request, *a, **kw)

    w = hooks.before("t.before", rec_fn if generated else generic_fn)(Manager.allocate)
    assert bool(getattr(w, "__pdtrace_fast__", False)) is generated
    Manager.allocate = w
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        assert Manager().allocate("r", 2) == ("r", 2, 0, False)
        assert Manager().allocate("s", 7) == ("s", 7, 0, False)  # recording failed, vLLM's call did not
        with pytest.raises(ValueError):
            Manager().allocate("t", -1)
    finally:
        recorder.set_current(prev)
    assert order == [("record", "r", 2), ("record", "s", 7), ("record", "t", -1)]
    assert rec.hook_errors == {"t.before": 1}


def test_around_skip_calls_just_the_original_and_contains_errors():
    """``around(skip=...)``: when the expression is true neither before nor after runs; when
    it raises, the error is counted and the hook runs as if not skipped; a skip naming the
    result (unknown before the call) is dropped."""
    Manager = _target()
    seen = []
    before_fn = lambda rec, self, request, n, *a, **kw: seen.append(("before", request))  # noqa: E731
    after_fn = lambda rec, st, result, self, request, n, *a, **kw: seen.append(("after", request))  # noqa: E731
    w = hooks.around("t.around", before_fn, after_fn, skip="request.startswith('plain')")(Manager.allocate)
    assert w.__pdtrace_fast__
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        assert w(Manager(), "plain-1", 1) == ("plain-1", 1, 0, False)
        assert w(Manager(), "pd-1", 1) == ("pd-1", 1, 0, False)
        assert w(Manager(), None, 1) == (None, 1, 0, False)  # skip raises: counted, hook runs
    finally:
        recorder.set_current(prev)
    assert seen == [("before", "pd-1"), ("after", "pd-1"), ("before", None), ("after", None)]
    assert rec.hook_errors == {"t.around": 1}
    src_free = hooks.around("t.around", before_fn, after_fn, skip="_pdt_result is None")(Manager.allocate)
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        src_free(Manager(), "x", 1)
    finally:
        recorder.set_current(prev)
    assert rec.hook_errors == {} and seen[-2:] == [("before", "x"), ("after", "x")]


def test_packed_step_tokens_and_spec_come_back_as_the_schema_dicts(tmp_path):
    """The scheduler hook queues sched.step's tokens / spec packed (hooks/scheduler.py); both
    sinks, and the JSON fallback for a field marshal cannot take, restore the dicts."""
    class Odd:
        def __repr__(self):
            return "<odd>"

    def fill(rec):
        # a decode step: counts < 256 as bytes, spec over the same requests (None)
        rec.put("sched.step", None, 1, {"inst": "D", "tokens": (["a", "b"], b"\x04\x02"), "spec": (None, b"\x03\x01")})
        # a prefill chunk (a count >= 256: a list) and spec over other requests than tokens
        rec.put("sched.step", None, 2, {"inst": "D", "tokens": (["a", "c"], [300, 4]), "spec": (["c"], [3])})
        # a field marshal cannot take: the event is written through its JSON form
        rec.put("sched.step", None, 3, {"inst": "D", "tokens": (["a"], b"\x02"), "spec": (None, b"\x01"), "odd": Odd()})

    _, (events, problems) = _shard_events(tmp_path, fill)
    mem = Recorder.in_memory(inst="D")
    fill(mem)
    mem.flush()
    assert problems == []
    for evs in (events, mem.events):
        assert [e["tokens"] for e in evs] == [{"a": 4, "b": 2}, {"a": 300, "c": 4}, {"a": 2}]
        assert [e["spec"] for e in evs] == [{"a": 3, "b": 1}, {"c": 3}, {"a": 1}]
    assert events[2]["odd"] == "<odd>"
    assert recorder.unpack_step({"tokens": {"a": 1}}) == {"tokens": {"a": 1}}  # a dict stays as it is


def test_a_hook_takes_another_releases_layout_when_its_own_is_absent(fake_target):
    """HookSpec.layouts: the primary target is missing here (as NixlBaseConnector is before 0.24),
    an older release's form (other class, other parameter names in the same positions) is patched,
    check()/check_form() say so, and uninstall restores it."""
    seen = []
    spec = hooks.register("test.layout", fake_target.__name__, "NewEngine.step", ("count", "factor"),
                          hooks.after("test.layout", lambda rec, result, self, n, *a, **kw: seen.append((n, result))),
                          layouts=((fake_target.__name__, "Engine.step", ("n", "scale"), "older releases"),))
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    orig = fake_target.Engine.step
    try:
        assert hooks.check_form(spec) == ("ok", "", (fake_target.__name__, "Engine.step", ("n", "scale")))
        assert hooks.check(spec) == ("ok", "")
        hooks.install_now()
        assert spec.status == "applied" and spec.applied_form[1] == "Engine.step"
        assert fake_target.Engine().step(3, scale=2) == 6 and seen == [(3, 6)]
        # neither form fits: the reason is the furthest one's (a signature drift beats a missing class)
        bad = hooks.register("test.layout_bad", fake_target.__name__, "NewEngine.step", ("count",),
                             hooks.after("test.layout_bad", lambda *a, **kw: None),
                             layouts=((fake_target.__name__, "Engine.step", ("m",), "older"),))
        status, why = hooks.check(bad)
        assert status == "skipped" and why.startswith("signature drift: expected (m, ...)")
    finally:
        hooks.uninstall_all()
        recorder.set_current(prev)
        hooks.REGISTRY.pop("test.layout", None)
        hooks.REGISTRY.pop("test.layout_bad", None)
    assert fake_target.Engine.step is orig


def test_a_layout_wrap_goes_with_its_own_parameters(fake_target):
    """Two releases lay the same method out with different parameters (NixlConnectorWorker._read_blocks:
    (read_spec, ...) in 0.22-0.23, (local_block_ids, remote_block_ids, ...) in 0.20-0.21) and only the
    second form has its own wrap: the form that matches here must get the spec's wrap, not the other's."""
    seen = []
    spec = hooks.register(
        "test.layout_wrap", fake_target.__name__, "NewEngine.step", ("count",),
        hooks.after("test.layout_wrap", lambda rec, result, self, *a, **kw: seen.append("spec wrap")),
        layouts=((fake_target.__name__, "Engine.step", ("n", "scale"), "the release here"),
                 (fake_target.__name__, "Engine.step", ("local", "remote"), "another release",
                  hooks.after("test.layout_wrap", lambda rec, result, self, *a, **kw: seen.append("other wrap")))))
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        hooks._apply(spec, fake_target, spec.forms()[1])
        assert spec.status == "applied"
        fake_target.Engine().step(2)
        assert seen == ["spec wrap"]
    finally:
        hooks.uninstall_all()
        recorder.set_current(prev)
        hooks.REGISTRY.pop("test.layout_wrap", None)
