"""Shared fixtures. vLLM-backed fixtures skip cleanly when vLLM is not importable.

The expensive pieces (vLLM import, VllmConfig + speculative config, the P/D scheduler
pair) are built once per session and cached per PDConfig.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# The suite runs under pytest-xdist (scripts/test.sh: -n 2). Its workers export COLUMNS / LINES
# (80x24) and PYTEST_XDIST_*; the tests' own subprocesses (pytest runs of pytest_plugin and vLLM's
# tests, tmux terminals, `check` through CliRunner, which wraps at COLUMNS) must see the
# environment a user's shell gives them, as in a plain run, not the outer worker's.
for _var in ("COLUMNS", "LINES", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
    os.environ.pop(_var, None)

# ---------------------------------------------------------------- a skip is a claim
# PDTRACE_STRICT_SKIPS=1 (scripts/test.sh sets it on x86-64 Linux, where everything the suite
# needs installs: vLLM for CPU, nixl, tmux, chromium) turns every skip into a failure unless
# its reason is a limit of the host that no install can lift, listed here with why. A laptop
# running pytest by hand keeps the ordinary skip with its reason.
STRICT_SKIPS = os.environ.get("PDTRACE_STRICT_SKIPS", "") not in ("", "0")
HOST_LIMITS = {
    "perfetto trace processor unavailable offline":
        "perfetto's TraceProcessor downloads trace_processor_shell from the internet on first use; "
        "these machines reach only package registries",
}
_disallowed: list[tuple[str, str]] = []


def _skip_reason(rep) -> str:
    lr = rep.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def _allowed(reason: str) -> bool:
    return any(key in reason for key in HOST_LIMITS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if STRICT_SKIPS and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = _skip_reason(rep)
        if not _allowed(reason):
            rep.outcome = "failed"
            rep.longrepr = (f"skipped where it must run (PDTRACE_STRICT_SKIPS=1; a skip hides a broken "
                            f"install or a broken preflight on this host): {reason}")


def pytest_collectreport(report):
    if STRICT_SKIPS and report.skipped:
        reason = _skip_reason(report)
        if not _allowed(reason):
            _disallowed.append((report.nodeid, reason))


def pytest_terminal_summary(terminalreporter):
    if _disallowed:
        terminalreporter.section("skips not allowed on this host (PDTRACE_STRICT_SKIPS=1)", red=True)
        for nodeid, reason in _disallowed:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _disallowed and session.exitstatus == 0:
        session.exitstatus = 1


# ---------------------------------------------------------------- the order files run in
# scripts/test.sh hands whole files to the 2 xdist workers (--dist loadfile, so a module's fixture is built once)
# in collection order (--no-loadscope-reorder), one file at a time to whichever worker is free. The longest files
# go first, so that no long file starts last while the other worker idles: with the default `load` the suite
# spent its last minutes on one worker. The order is each file's total seconds from `--durations=0` on 2 cores
# (2026-12-07, vLLM 0.32.0: test_upstream_vllm 160, test_pytest_plugin 136, ... test_causes 16), except
# test_arch_zoo, kept third: its fixture took 93 s on a machine's first run and 12 s on the next. A file not
# listed runs after these, in its usual order. Only the order changes.
HEAVY_FIRST = (
    "test_upstream_vllm.py", "test_pytest_plugin.py", "test_arch_zoo.py", "test_repro_standalone.py",
    "test_tui_features.py", "test_doctor_repro.py", "test_doctor_cmdline.py", "test_html_report_nav.py",
    "test_real_releases.py", "test_parallel.py", "test_tui.py", "test_tui_samples.py", "test_samples.py",
    "test_report.py", "test_fuzz.py", "test_stream.py", "test_report_browser.py", "test_ring.py", "test_causes.py",
)


# One run of the written repro tests per session: where tests/test_repro_standalone.py's test_each_class is selected
# (the suites, on their own vLLM), it and that file's first test run every bundled sample's written test as it is,
# hold each to the per-release table (tests/repro_table.py) and put it beside its labelled fault or fix;
# test_real_releases.py's standalone-repro test would run the same files again (25-33 s), so it is deselected there
# (the header says so). It runs wherever test_each_class is not selected (-k, a single file): the release loop of
# scripts/test.sh --all runs tests/test_real_releases.py alone in each release venv.
ONE_REPRO_RUN = ("test_repro_standalone.py::test_each_class_fails_with_the_bug_and_passes_without_it",
                 "test_real_releases.py::test_the_standalone_repro_fails_exactly_where_the_release_carries_the_bug")


def pytest_report_header(config):
    return ["written repro tests run once: where test_each_class is selected, the",
            "same run in test_real_releases is deselected (tests/conftest.py ONE_REPRO_RUN)"]


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected theirs: test_each_class must be the one that runs
def pytest_collection_modifyitems(session, config, items):
    runs_all, again = ONE_REPRO_RUN
    if any(it.nodeid.endswith(runs_all) for it in items):
        left_out = [it for it in items if it.nodeid.endswith(again)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [it for it in items if not it.nodeid.endswith(again)]
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # (stable: within a file, and after the list, as collected)


def _need_vllm() -> None:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (pip install 'pdtrace[record]')")


@pytest.fixture(scope="session")
def pd_harness():
    """The pdtrace.testing.pd_harness module (imports vLLM)."""
    _need_vllm()
    from pdtrace.testing import pd_harness

    return pd_harness


@pytest.fixture(scope="session")
def pd_pair(pd_harness):
    """pd_pair(cfg) -> a PDPair (real P and D schedulers + in-memory recorder), one per config per session.

    Each run_pd_request(..., pair=pair) returns only its own events, so tests can share pairs.
    """
    cache: dict = {}

    def get(cfg=None):
        cfg = cfg or pd_harness.PDConfig()
        if cfg not in cache:
            cache[cfg] = pd_harness.make_pair(cfg)
        return cache[cfg]

    return get


# ---------------------------------------------------------------- live runs (tests/test_live_*.py)

@pytest.fixture(scope="session")
def live_scripts():
    """scripts/ importable, after the live preflight: skips with its reason where a live run
    cannot work (a failure under PDTRACE_STRICT_SKIPS=1). Returns a namespace with the
    live_cpu_pd and live_cpu_hybrid modules and ``workdir(name, tmp_path_factory)``:
    $PDTRACE_LIVE_WORKDIR/name when set (artifacts kept), else a fresh temp dir."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    import live_cpu_hybrid
    import live_cpu_pd

    why = live_cpu_pd.preflight()
    if why:
        pytest.skip(f"live CPU run impossible here: {why}")

    def workdir(name, tmp_path_factory):
        base = os.environ.get("PDTRACE_LIVE_WORKDIR")
        return Path(base) / name if base else tmp_path_factory.mktemp(name)

    return SimpleNamespace(pd=live_cpu_pd, hybrid=live_cpu_hybrid, workdir=workdir)


def served_live(live_scripts, name: str, tmp_path_factory, **kw) -> dict:
    """One live P/D run (``live_cpu_pd.run_live`` with ``kw``, EAGLE k=3, block 32 unless said)
    that must have served and merged: its result with the merged trace's events (``events``)."""
    import live_servers

    L = live_scripts.pd
    kw = {"spec": "eagle", "num_spec": 3, "block_size": 32, "log": lambda m: None, **kw}
    # every live run records the KV digests (issue 60): on correct vLLM every compared block must agree, and the
    # tests' "no finding" holds that (the expired-lease test checks they differ exactly where tokens do)
    old = list(live_servers.RECORD_ARGS)
    every = kw.pop("kv_checksum_every", None)  # (record --kv-checksum-every N: one request in N)
    if "--kv-checksum" not in old:
        live_servers.RECORD_ARGS[:] = old + ["--kv-checksum"] + (["--kv-checksum-every", str(every)] if every else [])
    try:
        res = L.run_live(live_scripts.workdir(name, tmp_path_factory), **kw)
    finally:
        live_servers.RECORD_ARGS[:] = old
    print(L.format_report(res))
    assert res["status"] == "served", L.format_report(res)
    assert res.get("summary"), f"no merged trace: {res.get('merge')}"
    res["events"] = load_live_events(res)
    return res


def said(check: dict) -> str:
    """A live run's `pdtrace check -f json` as a failure message a CI log keeps whole: rc, then each finding's
    kind, request, title, why and its mechanism (the run's folder is gone when CI's log is read)."""
    out = [f"check rc {check.get('rc')}; stderr: {(check.get('stderr') or '').strip()[-300:]}"]
    for f in check.get("findings") or []:
        out.append(f"- {f.get('severity')} {f.get('kind')} {f.get('req')} step {f.get('step')} on {f.get('inst')}: "
                   f"{f.get('title')}\n  why: {f.get('why')}\n  data: "
                   + str({k: v for k, v in (f.get('data') or {}).items() if k != 'chain'})[:1500])
    return "\n".join(out)


def groups_follow_vllm(res: dict) -> list[dict]:
    """A live run's per-KV-cache-group facts (kv-never-crossed, issue 51) and the viewer's Block map, held to vLLM's
    own lists: D's whole list for each loaded request (``nixl.remote_alloc.local_block_ids``, the scheduler's, null
    block 0 at an out-of-window position); a loaded position whose block is real is one the group got. Every D
    request's Block map shows no MISMATCH (correct vLLM). Returns the pair's groups."""
    from pdtrace.commands.view import open_source
    from pdtrace.detectors import crossed
    from pdtrace.viewers.tui import model

    evs = res["events"]
    (cfg,) = [e for e in evs if e["ev"] == "sched.config" and e.get("inst") == "D"][:1]
    first = {a["req"]: a for a in evs if a["ev"] == "sched.alloc" and a.get("inst") == "D"
             and "num_external_computed_tokens" in a}
    want = [0] * len(cfg["group_kinds"])
    idx = open_source(res["trace"])
    idx.build()
    allocs = [a for a in evs if a["ev"] == "nixl.remote_alloc" and a.get("inst") == "D"]
    for a in allocs:
        f = first[a["req"]]
        lo, ext = f["num_new_computed_tokens"], f["num_external_computed_tokens"]
        for g, blocks in enumerate(a["local_block_ids"]):
            bs = cfg["block_sizes"][g]
            want[g] += sum(1 for p in range(lo, lo + ext) if blocks[p // bs] != 0)
        bm = model.block_map(idx, a["req"])
        assert bm is not None and bm.mismatches == 0, (a["req"], [p.why for g in bm.groups for p in g.pairs if not p.ok])
    (pair,) = [n for n in crossed.pair_notes(evs) if n["p_inst"] not in (None, "?")]
    assert [r["loaded"] for r in pair["groups"]] == want and len(allocs) >= 5, (pair["groups"], want)
    return pair["groups"]


def load_live_events(res: dict) -> list:
    """The merged trace of a live run, loaded strictly (a damaged trace fails the test)."""
    from pdtrace.tracefile.trace import load

    return load(res["trace"], lenient=False).events


@contextlib.contextmanager
def small_tmpfs(where, size: str):
    """A tmpfs of ``size`` mounted at ``where`` (a new directory) for disk-full tests; skips
    with the reason where mounting is not allowed (a failure under PDTRACE_STRICT_SKIPS=1)."""
    import subprocess

    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
