"""`pdtrace record` under faults (issue 20), with real subprocesses, files and signals:
an output that cannot be written, a disk that fills at merge time, `record` itself
SIGKILLed, and processes that outlive the recorded command."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import small_tmpfs

from pdtrace.commands.view import open_source
from pdtrace.tracefile.trace import load

PDTRACE = [sys.executable, "-m", "pdtrace"]
ENV = dict(os.environ, PDTRACE_HOOKS="0")  # process events and marks only: no vLLM here

# A recorded program: N marks through the active recorder, then exit 5.
BULK = ("import sys\nfrom pdtrace.record import recorder\nr = recorder.get()\n"
        "for i in range(int(sys.argv[1])):\n    r.emit('mark', label='bulk', detail='x' * 40 + str(i))\n"
        "sys.exit(5)\n")


def _record(*args, timeout=120):
    return subprocess.run(PDTRACE + ["record", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_unwritable_output_fails_before_the_program_runs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ran = tmp_path / "ran"
    r = _record("-o", str(blocker / "t.jsonl"), "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert str(blocker / "t.jsonl") in lines[0] and "nothing was run" in lines[0]
    assert not ran.exists()  # the program never started
    assert not list(tmp_path.glob(".pdtrace-*"))



def test_disk_full_at_merge_keeps_the_shards_and_the_exit_code(tmp_path):
    """4000 marks: ~330 kB of shards fit on a 768 kB disk, the ~690 kB JSON trace does not."""
    prog = tmp_path / "bulk.py"
    prog.write_text(BULK)
    with small_tmpfs(tmp_path / "disk", "768k") as disk:
        out = disk / "t.jsonl"
        r = _record("-o", str(out), "--", sys.executable, str(prog), "4000")
        assert r.returncode == 5, r.stderr  # the program's code, not pdtrace's
        assert "Traceback" not in r.stderr
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("pdtrace: error:")]
        assert len(err) == 1 and "No space left on device" in err[0], r.stderr
        assert "pdtrace merge" in err[0]
        assert not out.exists() and not Path(str(out) + ".tmp").exists()  # no half-written file
        (shard_dir,) = disk.glob(".pdtrace-*")
        assert str(shard_dir) in err[0]
        kept = tmp_path / "kept"
        shutil.copytree(shard_dir, kept)  # what a user does: recover where there is room
    rec = tmp_path / "recovered.jsonl"
    m = subprocess.run(PDTRACE + ["merge", str(kept), "-o", str(rec)], capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    tr = load(str(rec))
    assert sum(e["ev"] == "mark" for e in tr.events) == 4000
    assert tr.footer["processes"][0]["complete"] is True


def test_sigkill_of_record_then_recover_with_merge_and_view(tmp_path):
    out = tmp_path / "t.jsonl"
    prog = ("import time\nfrom pdtrace.record import recorder\nrecorder.get().emit('mark', label='before-kill')\n"
            "time.sleep(60)\n")
    p = subprocess.Popen(PDTRACE + ["record", "-o", str(out), "--", sys.executable, "-c", prog],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    child = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            shards = list(tmp_path.glob(".pdtrace-*/*.pdshard"))
            if shards and b"before-kill" in shards[0].read_bytes():
                child = int(shards[0].name.split(".")[0])
                break
            time.sleep(0.1)
        else:
            pytest.fail("the program never flushed its mark")
        p.send_signal(signal.SIGKILL)  # record dies at once: no merge, no cleanup
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)  # the program outlives record; stop it (it flushes)
    _, err = p.communicate(timeout=30)  # (the program held record's stderr pipe open until now)
    (shard_dir,) = tmp_path.glob(".pdtrace-*")
    assert f"pdtrace merge {shard_dir}" in err  # said up front, since nothing can be said at the kill
    assert not out.exists()
    deadline = time.time() + 30
    while time.time() < deadline and b"proc.exit" not in next(shard_dir.glob("*.pdshard")).read_bytes():
        time.sleep(0.1)
    rec = tmp_path / "recovered.jsonl"
    m = subprocess.run(PDTRACE + ["merge", str(shard_dir), "-o", str(rec)], capture_output=True, text=True,
                       timeout=120)
    assert m.returncode == 0, m.stderr
    tr = load(str(rec))
    assert [e["label"] for e in tr.events if e["ev"] == "mark"] == ["before-kill"]
    idx = open_source(str(shard_dir))  # what `pdtrace view DIR` shows
    kinds = [idx.kind(i) for i in range(len(idx))]
    assert "mark" in kinds and "proc.start" in kinds


def _orphan_program(sleep: float, ready: Path) -> str:
    """Main starts a detached child (new session, never waited for) and exits once the child
    has started recording (``ready`` exists: its shard is open); the child marks, sleeps,
    marks again and exits. (A process that has not opened its shard by the time CMD exits is
    not waited for.)"""
    inner = (f"import time\nfrom pdtrace.record import recorder\nr = recorder.get()\nr.emit('mark', label='orphan-early')\n"
             f"open({str(ready)!r}, 'w').close()\n"
             f"time.sleep({sleep})\nr.emit('mark', label='orphan-late')\n")
    return ("import os, subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {inner!r}], start_new_session=True,\n"
            "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print(p.pid, flush=True)\n"
            f"while not os.path.exists({str(ready)!r}):\n"
            "    time.sleep(0.05)\n")


def test_orphaned_worker_is_waited_for(tmp_path):
    out = tmp_path / "t.jsonl"
    r = _record("-o", str(out), "--", sys.executable, "-c", _orphan_program(2.0, tmp_path / "ready"))
    assert r.returncode == 0, r.stderr
    assert "waiting up to 10s for 1 process(es)" in r.stderr
    tr = load(str(out))
    labels = [e["label"] for e in tr.events if e["ev"] == "mark"]
    assert labels == ["orphan-early", "orphan-late"]
    assert all(p["complete"] for p in tr.footer["processes"])


def test_orphan_still_running_after_the_wait_is_reported(tmp_path):
    out = tmp_path / "t.jsonl"
    r = _record("-o", str(out), "--orphan-wait", "0.5", "--", sys.executable, "-c", _orphan_program(60, tmp_path / "ready"))
    orphan = int(r.stdout.split()[0])
    try:
        assert r.returncode == 0, r.stderr
        warn = [ln for ln in r.stderr.splitlines() if "still running after 0.5s" in ln]
        assert len(warn) == 1 and f"pid {orphan}" in warn[0], r.stderr
        tr = load(str(out))
        procs = {p["pid"]: p for p in tr.footer["processes"]}
        assert procs[orphan]["complete"] is False  # the trace says so too
        assert [e["label"] for e in tr.events if e["ev"] == "mark"] == ["orphan-early"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
