"""``pytest --pdtrace``: each test recorded into its own trace and checked when it ends (issue 37).

Shipped as the ``pdtrace`` pytest11 entry point: loaded by every pytest run where pdtrace is
installed, and inert unless ``--pdtrace`` (or ``pdtrace = true`` in the ini file) turns it on;
``-p no:pdtrace`` unloads it. Off, it adds four options and two markers and nothing else: no hook
installed, no recorder, no import of vLLM.

On, per test (``@pytest.mark.pdtrace_skip`` opts one out):

- a recorder for the test process starts before its fixtures are set up (schedulers built by a
  fixture are in the trace), writing to ``<dir>/<test>/shards``; processes the test starts
  inherit the bootstrap (``PYTHONPATH``, ``PDTRACE_SESSION_DIR``) for the test's duration, as
  under ``pdtrace record``, and write their own shards there;
- the hooks are installed once per process (``hooks.install_all``: patched when vLLM's modules
  are imported), and each test's trace gets their status (``hooks.status``), so coverage says
  what the test could see;
- after the test body, the shards become ``<dir>/<test>.jsonl`` and the detectors run on it
  (``detectors.checking.check_file``); a finding at or above ``--pdtrace-fail-on`` (default
  error) fails the test, with the findings and the trace path in a "pdtrace" report section;
  ``@pytest.mark.pdtrace_expect("kind", ...)`` passes the test only if exactly those classes are
  found (a regression test of a known bug). Traces of passing tests are deleted unless
  ``--pdtrace-keep all``.

After the run, a terminal summary: tests recorded, events, findings per class, tests whose
classes were "not checked", the slowest recordings. Under pytest-xdist each worker records its own
tests; the summary is gathered from the reports.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import textwrap
import time
from typing import Any

import pytest

LEVELS = {"error": ("error",), "warning": ("error", "warning"), "never": ()}
KEEP = ("failed", "all")
_KEY = "pdtrace"  # report.user_properties key (travels from xdist workers to the controller)


def pytest_addoption(parser: Any) -> None:
    g = parser.getgroup("pdtrace", "pdtrace: record each test's vLLM P/D activity and check it")
    g.addoption("--pdtrace", action="store_true", default=None,
                help="record each test into its own pdtrace trace and run the detectors on it")
    g.addoption("--pdtrace-dir", metavar="DIR", default=None,
                help="where the per-test traces go (default: pdtrace/ under pytest's base temp dir)")
    g.addoption("--pdtrace-fail-on", choices=tuple(LEVELS), default=None,
                help="fail a test whose trace has a finding of this severity or worse (default: error)")
    g.addoption("--pdtrace-keep", choices=KEEP, default=None,
                help="keep the traces of failed tests only (default) or of all tests")
    parser.addini("pdtrace", "record and check each test (as --pdtrace)", type="bool", default=False)
    parser.addini("pdtrace_dir", "as --pdtrace-dir", default="")
    parser.addini("pdtrace_fail_on", "as --pdtrace-fail-on (error, warning, never)", default="error")
    parser.addini("pdtrace_keep", "as --pdtrace-keep (failed, all)", default="failed")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "pdtrace_expect(*kinds): with --pdtrace, the test passes only if its "
                                       "trace's findings are of exactly these bug classes")
    config.addinivalue_line("markers", "pdtrace_skip: with --pdtrace, do not record this test")
    ini = f"{config.inipath}: " if getattr(config, "inipath", None) else ""
    on = config.getoption("pdtrace")
    if on is None:
        try:
            on = config.getini("pdtrace")
        except ValueError as exc:  # pytest's own bool parsing: one line, not an INTERNALERROR
            raise pytest.UsageError(f"{ini}pdtrace: {exc} (true or false)") from None
    if not on:
        return
    fail_on = config.getoption("pdtrace_fail_on") or config.getini("pdtrace_fail_on") or "error"
    keep = config.getoption("pdtrace_keep") or config.getini("pdtrace_keep") or "failed"
    if fail_on not in LEVELS:
        raise pytest.UsageError(f"{ini}pdtrace_fail_on = {fail_on!r}: one of {', '.join(LEVELS)}")
    if keep not in KEEP:
        raise pytest.UsageError(f"{ini}pdtrace_keep = {keep!r}: one of {', '.join(KEEP)}")
    config.pluginmanager.register(PdtracePlugin(config, fail_on, keep), "pdtrace-session")


_ACTIVE: "_Recording | None" = None  # the test being recorded in this process (for forked children)
_FORK_HOOK = False


def _child_after_fork() -> None:
    """A child forked during a recorded test (multiprocessing's fork start method) records into
    the test's shard dir with its own shard, as under `pdtrace record`; the parent's recorder
    object it inherited is let go unclosed (its file is the parent's)."""
    r = _ACTIVE
    if r is None:
        return
    from pdtrace.record import recorder as _recorder

    old = _recorder.get()
    _recorder.start_process_recording(r.shards, session=r.nodeid, redact=True,
                                      role=getattr(old, "role", "main"), inst=getattr(old, "inst", "-"))


def _safe(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[-150:] or "test"


class _Recording:
    """One test's recording: its recorder, its shard dir, the environment it set for children."""

    def __init__(self, base: str, nodeid: str):
        from pdtrace.record import recorder as _recorder
        from pdtrace.record.bootstrap.runtime import BOOTSTRAP_DIR

        self.nodeid, self.t0 = nodeid, time.monotonic()
        self.name = _safe(nodeid)
        self.shards = os.path.join(base, self.name + ".shards")
        shutil.rmtree(self.shards, ignore_errors=True)
        self.trace = os.path.join(base, self.name + ".jsonl")
        self.rec = _recorder.Recorder.to_shard_dir(self.shards, redact=True)
        self.prev = _recorder.set_current(self.rec)
        self.rec.proc_start(session=nodeid)
        self.rec.emit("mark", label="pytest", detail=nodeid)
        from pdtrace.hooks.install import _report_status

        _report_status()  # this trace's hooks.status: what the test could see
        env = {"PDTRACE_SESSION_DIR": os.path.abspath(self.shards), "PDTRACE_SESSION": nodeid,
               "PDTRACE_REDACT": "1",
               "PYTHONPATH": BOOTSTRAP_DIR + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else "")}
        self.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        global _ACTIVE, _FORK_HOOK
        _ACTIVE = self
        if not _FORK_HOOK and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_child_after_fork)
            _FORK_HOOK = True

    def stop(self) -> None:
        from pdtrace.record import recorder as _recorder

        global _ACTIVE
        _ACTIVE = None
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _recorder.set_current(self.prev)
        self.rec.close()


class PdtracePlugin:
    def __init__(self, config: Any, fail_on: str, keep: str):
        self.config, self.fail_on, self.keep = config, fail_on, keep
        self.dir: str | None = None
        self.active: dict[str, _Recording] = {}
        self.results: list[dict] = []  # one per recorded test (this process, or gathered from xdist workers)
        self._hooks = False

    # -- where the traces go ---------------------------------------------------------------
    def _base(self) -> str:
        if self.dir is None:
            d = self.config.getoption("pdtrace_dir") or self.config.getini("pdtrace_dir")
            if not d:
                d = str(self.config._tmp_path_factory.getbasetemp() / "pdtrace")  # noqa: SLF001
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            self.dir = os.path.join(os.path.abspath(d), worker) if worker else os.path.abspath(d)
            os.makedirs(self.dir, exist_ok=True)
        return self.dir

    def _install_hooks(self) -> None:
        if not self._hooks:
            from pdtrace import hooks

            hooks.install_all()
            self._hooks = True

    # -- per test ------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: Any) -> Any:
        if item.get_closest_marker("pdtrace_skip") is None:
            self._install_hooks()
            self.active[item.nodeid] = _Recording(self._base(), item.nodeid)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        outcome = yield
        rep = outcome.get_result()
        recording = self.active.get(item.nodeid)
        if recording is None or (call.when == "setup" and rep.passed):
            return
        del self.active[item.nodeid]
        recording.stop()
        res = self._check(recording, ran=call.when == "call" and not rep.skipped)
        verdict = self._verdict(item, res) if res.get("checked") else None
        if verdict is not None and rep.passed:
            rep.outcome, rep.longrepr = "failed", verdict
        res["failed"] = rep.failed
        if res.get("trace") and not rep.failed and self.keep != "all":
            os.remove(res["trace"])
            res["trace"] = None
        text = self._section(res, verdict)
        if text:
            rep.sections.append(("pdtrace", text))
        # the item's properties: the teardown report carries them (to pytest-xdist's controller, to
        # --junitxml's <properties>), and the summary reads them there, once per test
        item.user_properties.append((_KEY, json.dumps(res)))

    def _check(self, r: _Recording, ran: bool) -> dict:
        """The shards as one trace, and the detectors' findings and coverage on it."""
        from pdtrace.detectors.checking import check_file
        from pdtrace.record.shards import finalize_session

        res: dict[str, Any] = {"test": r.nodeid, "trace": None, "events": 0, "findings": [], "not_checked": [],
                               "checked": False, "record_s": round(time.monotonic() - r.t0, 3)}
        t = time.monotonic()
        try:
            finalize_session(r.shards, r.trace, cmd=["pytest", r.nodeid], redacted=True, exit_code=None)
            shutil.rmtree(r.shards, ignore_errors=True)
            res["trace"] = r.trace
            if ran:
                checked = check_file(r.trace)
                res["checked"] = True
                res["events"] = checked.trace.n_events
                res["findings"] = [{k: f.to_dict()[k] for k in ("kind", "severity", "req", "step", "inst", "title", "data",
                                                                "explanation")} for f in checked.findings]
                res["not_checked"] = sorted(k for k, c in checked.coverage.items() if c.status == "not-checked")
        except Exception as exc:  # a recording that cannot be read: said in the report, never a pass by silence
            res["error"] = f"{type(exc).__name__}: {exc}"
        res["check_s"] = round(time.monotonic() - t, 4)
        return res

    def _verdict(self, item: Any, res: dict) -> str | None:
        """The failure text, or None: the findings at the fail-on level, or (pdtrace_expect) the
        classes found against the classes expected."""
        bad = [f for f in res["findings"] if f["severity"] in LEVELS[self.fail_on]]
        mark = item.get_closest_marker("pdtrace_expect")
        trace = f"trace: {res['trace']}"
        if mark is not None:
            want = set(mark.args)
            found = [f for f in res["findings"] if f["severity"] in ("error", "warning")]
            # one bug, one class: the KV invariant's findings that join a rule's cause are that rule's bug
            # (detectors.causes.group), so a test that expects the rule is not failed for the invariant's agreement
            from pdtrace.detectors.causes import group

            got = {c.kind for c in group(found)}
            if got == want or {f["kind"] for f in found} == want:
                return None
            return (f"pdtrace: expected findings of {sorted(want) or 'no class'}, found {sorted(got) or 'none'}\n"
                    + "".join(_finding_lines(f) for f in res["findings"]) + trace)
        if not bad:
            return None
        return (f"pdtrace: {len(bad)} finding(s) at or above '{self.fail_on}' in this test's trace\n"
                + "".join(_finding_lines(f) for f in bad) + trace)

    @staticmethod
    def _section(res: dict, verdict: str | None) -> str:
        if res.get("error"):
            return f"pdtrace could not read this test's recording: {res['error']}"
        if verdict is not None or not res["findings"]:
            return ""
        return "".join(_finding_lines(f) for f in res["findings"]) + f"trace: {res['trace'] or '(not kept)'}"

    # -- the summary -------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "teardown":
            return
        for key, value in getattr(report, "user_properties", ()):
            if key == _KEY:
                self.results.append(json.loads(value))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        tr.section("pdtrace")
        res = self.results
        width = max(60, getattr(tr, "_tw", None).fullwidth if getattr(tr, "_tw", None) else 80)

        def line(text: str) -> None:
            for x in textwrap.wrap(text, width=width - 1, subsequent_indent="    ", break_on_hyphens=False):
                tr.write_line(x)

        kinds = collections.Counter(f["kind"] for r in res for f in r["findings"]
                                    if f["severity"] in ("error", "warning"))
        # a test whose trace has nothing of vLLM leaves every class "not checked": said once, not per class
        n_classes = max((len(r["not_checked"]) for r in res), default=0)
        quiet = [r for r in res if r.get("checked") and r["not_checked"] and len(r["not_checked"]) == n_classes
                 and not r["findings"] and n_classes >= 5]
        blind = collections.Counter(k for r in res if r not in quiet for k in r["not_checked"])
        kept = [r for r in res if r.get("trace")]
        where = (f"{len(kept)} trace(s) kept in {self.dir}" if kept else
                 f"no trace kept (--pdtrace-keep {self.keep}: the traces of passing tests are deleted)")
        line(f"{len(res)} test(s) recorded, {sum(r['events'] for r in res)} events; {where}")
        if quiet:
            line(f"{len(quiet)} test(s) recorded no vLLM activity (every bug class 'not checked' there)")
        line("findings per class: " + (", ".join(f"{k} {n}" for k, n in kinds.most_common()) or "none"))
        failed = [r for r in res if r.get("failed") and (r["findings"] or r.get("error"))]
        for r in failed[:10]:
            line(f"  {r['test']}: {len(r['findings'])} finding(s); trace {r['trace']}")
        if blind:
            line("classes not checked (tests): " + ", ".join(f"{k} ({n})" for k, n in blind.most_common()))
        errors = [r for r in res if r.get("error")]
        if errors:
            line(f"recordings that could not be read: {len(errors)} (first: {errors[0]['error']})")
        slow = sorted(res, key=lambda r: -(r["record_s"] + r["check_s"]))[:3]
        if slow:
            line("longest recordings: " + ", ".join(
                f"{r['test']} ({r['record_s']:.2f} s recorded, {r['check_s'] * 1000:.0f} ms to write and check)"
                for r in slow))


def _finding_lines(f: dict) -> str:
    where = " ".join(x for x in (f"step {f['step']}" if f.get("step") is not None else "",
                                  f"inst {f['inst']}" if f.get("inst") else "", f"req {f['req']}" if f.get("req") else "")
                     if x)
    return f"  {f['severity'].upper()} {f['kind']} {where}: {f['title']}\n"
