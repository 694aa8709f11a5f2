"""`pdtrace record` end to end on a real multi-process Python program (no vLLM needed).

The program (tests/programs/mp_app.py) starts multiprocessing `spawn` children, a child
that gets SIGKILLed, and a plain subprocess; the recorder must reach all of them through
the bootstrap on PYTHONPATH.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdtrace.tracefile.trace import load

APP = str(Path(__file__).parent / "programs" / "mp_app.py")
PDTRACE = [sys.executable, "-m", "pdtrace"]


def _record(tmp_path, *args, out="t.jsonl", extra=(), **kw):
    out_path = tmp_path / out
    cmd = PDTRACE + ["record", "-o", str(out_path), *extra, "--", sys.executable, APP, *args]
    env = dict(os.environ, PDTRACE_HOOKS="0")  # process events only: this test is about the recorder
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kw)
    return proc, out_path


def test_every_process_lands_in_one_trace(tmp_path):
    proc, out = _record(tmp_path, "--kill-child", "--exit", "3")
    assert proc.returncode == 3, proc.stderr  # record's exit code is the command's
    assert "result [1, 4, 9] sub-ok" in proc.stdout  # the program's own result is unchanged
    tr = load(str(out))  # strict: a complete, valid trace
    marks = {}
    for e in tr.events:
        if e["ev"] == "mark":
            marks.setdefault(e["label"], []).append(e)
    main_pid = marks["main-start"][0]["pid"]
    child_pids = {e["pid"] for e in marks["child"]}
    assert main_pid not in child_pids and len(child_pids) >= 1  # spawn children recorded themselves
    assert all(e["role"] == "worker" and "rank" in e for e in marks["child"])  # role set in-process is carried
    assert marks["main-start"][0]["role"] == "main"
    assert marks["subprocess"][0]["pid"] not in child_pids | {main_pid}  # the plain subprocess too
    # the SIGKILLed child: its earlier event survived, it has no proc.exit, the footer says so
    doomed = marks["doomed-before-kill"][0]["pid"]
    procs = {p["pid"]: p for p in tr.footer["processes"]}
    assert procs[doomed]["complete"] is False
    assert procs[main_pid]["complete"] is True
    assert tr.footer["exit_code"] == 3
    assert [e["id"] for e in tr.events] == list(range(len(tr.events)))
    ts = [e["t"] for e in tr.events]
    assert ts == sorted(ts)  # one host: merged in monotonic time order
    assert not list(tmp_path.glob(".pdtrace-*"))  # shard directory cleaned up


def test_multiprocessing_children_that_return_at_once_keep_their_last_events(tmp_path):
    """A fork child and a spawn child each emit 300 marks and return within one flush interval.
    multiprocessing ends them with os._exit() (atexit never runs: this is how vLLM's engine core
    and workers end), so their recorders must close through threading's exit hooks: every mark
    and each child's proc.exit (the footer's "complete") reach the trace."""
    proc, out = _record(tmp_path, "--burst", "300")
    assert proc.returncode == 0, proc.stderr
    tr = load(str(out))
    by_pid: dict[int, int] = {}
    for e in tr.events:
        if e["ev"] == "mark" and e["label"] == "burst":
            by_pid[e["pid"]] = by_pid.get(e["pid"], 0) + 1
    assert sorted(by_pid.values()) == [300, 300], by_pid
    procs = {p["pid"]: p for p in tr.footer["processes"]}
    for pid in by_pid:
        assert procs[pid]["complete"] is True, procs[pid]
    exits = [e for e in tr.events if e["ev"] == "proc.exit" and e["pid"] in by_pid]
    assert len(exits) == 2 and all(x["dropped"] == 0 for x in exits)


def test_main_process_closes_after_its_own_atexit_handlers(tmp_path):
    """The threading exit hook closes recorders only in multiprocessing children: in a main
    process threading._shutdown() runs BEFORE atexit, and a mark the program records from its
    own atexit handler must still reach the trace, before that process's proc.exit."""
    proc, out = _record(tmp_path, "--atexit-mark")
    assert proc.returncode == 0, proc.stderr
    tr = load(str(out))
    (late,) = [e for e in tr.events if e["ev"] == "mark" and e["label"] == "at-exit"]
    (exit_ev,) = [e for e in tr.events if e["ev"] == "proc.exit" and e["pid"] == late["pid"]]
    assert late["t"] <= exit_ev["t"]


def test_sigterm_mid_run_still_gives_a_valid_trace(tmp_path):
    out = tmp_path / "term.jsonl"
    cmd = PDTRACE + ["record", "-o", str(out), "--", sys.executable, APP, "--sleep", "60"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PDTRACE_HOOKS="0"))
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until the program is asleep (its mark reached disk)
        shards = list(tmp_path.glob(".pdtrace-*/*.pdshard"))
        if any(b"sleeping" in s.read_bytes() for s in shards):  # marshal keeps str bytes as is
            break
        time.sleep(0.2)
    else:
        p.kill()
        pytest.fail("program never reached its sleep")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    tr = load(str(out))  # strict load: header, footer, no problems
    labels = [e["label"] for e in tr.events if e["ev"] == "mark"]
    assert "sleeping" in labels
    main = [e for e in tr.events if e["ev"] == "proc.exit" and e["pid"] == tr.events[0]["pid"]]
    assert main, "the SIGTERMed main process flushed and wrote proc.exit before dying"
    assert tr.footer["exit_code"] == 128 + signal.SIGTERM


def test_secrets_in_the_command_line_are_masked(tmp_path):
    proc, out = _record(tmp_path, "--exit", "0", "--api-key", "sk-SECRET", "HF_TOKEN=hf_abc")
    tr = load(str(out))
    text = out.read_text()
    assert "sk-SECRET" not in text and "hf_abc" not in text
    assert "--api-key" in tr.header["cmd"] and "***" in tr.header["cmd"]
    assert tr.header["redacted"] is True


def test_missing_command_is_a_clear_error(tmp_path):
    r = subprocess.run(PDTRACE + ["record", "-o", str(tmp_path / "x.jsonl"), "--", "/nonexistent/prog"],
                       capture_output=True, text=True)
    assert r.returncode == 127
    assert "cannot start" in r.stderr
