"""`pdtrace record --ring SECONDS` (issue 22's flight recorder) end to end on a real
multi-process program: only about the last SECONDS of events stay on disk and in the trace,
process-level events are all kept, the footer counts what was discarded, and SIGUSR1 writes a
snapshot while the command runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdtrace.record.ring import SegmentRing
from pdtrace.tracefile.trace import load

APP = str(Path(__file__).parent / "programs" / "steady_app.py")


def _record(tmp_path, *args, ring="0.6"):
    out = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(out), "--ring", ring, "--",
                           sys.executable, APP, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PDTRACE_HOOKS="0"))
    return proc, out


def test_ring_keeps_the_last_window_and_counts_the_rest(tmp_path):
    proc, out = _record(tmp_path, "3")
    assert proc.returncode == 0, proc.stderr
    tr = load(str(out))
    assert tr.header["ring_s"] == 0.6 and "snapshot" not in tr.header
    emitted = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.split("\n") if line}
    for who in ("main", "child"):
        marks = [int(e["detail"]) for e in tr.events if e["ev"] == "mark" and e["label"] == who]
        assert marks == list(range(marks[0], emitted[who]))  # the newest ones, none missing
        assert 0 < len(marks) < emitted[who] // 2  # 3 s of marks, a ~0.6-0.75 s window
        span_ns = max(e["t"] for e in tr.events if e.get("label") == who) - \
            min(e["t"] for e in tr.events if e.get("label") == who)
        assert span_ns < 1.5e9
    kinds = {e["ev"] for e in tr.events}
    assert {"proc.start", "proc.exit"} <= kinds  # proc.start is pinned: never rotated out
    exits = [e for e in tr.events if e["ev"] == "proc.exit"]
    assert tr.footer["ring_discarded"] == sum(e["ring_discarded"] for e in exits) > 0
    # every event a process emitted is either in the trace or counted as discarded
    for x in exits:
        kept = sum(1 for e in tr.events if e["pid"] == x["pid"])
        assert kept + x["ring_discarded"] == x["events"], (kept, x)


def test_sigusr1_writes_a_snapshot_and_the_command_goes_on(tmp_path):
    proc, out = _record(tmp_path, "2", "signal-parent", ring="5")
    assert proc.returncode == 0, proc.stderr
    snap = tmp_path / "t.snapshot-1.jsonl"
    assert "pdtrace: snapshot" in proc.stderr and snap.exists(), proc.stderr
    s, final = load(str(snap)), load(str(out))  # strict: whole frames only
    assert s.header["snapshot"] == "SIGUSR1" and "exit_code" not in s.footer
    assert 0 < sum(e["ev"] == "mark" for e in s.events) < sum(e["ev"] == "mark" for e in final.events)
    assert not list(tmp_path.glob(".pdtrace-*"))


def test_an_online_check_asks_for_a_snapshot_by_itself(tmp_path):
    """A racy accepted-count read half-way through a 3 s run: the writer thread's online check
    (pdtrace.record.online) writes its trigger and signals record, which writes a snapshot whose
    header names the rule, the pid and the step, and which holds the read; no SIGUSR1 is
    sent by anyone else. The trace written at exit has it too."""
    proc, out = _record(tmp_path, "3", "racy-read", ring="5")
    assert proc.returncode == 0, proc.stderr
    assert "online check: racy accepted-count read: req-racy step 7" in proc.stderr, proc.stderr
    snap = tmp_path / "t.snapshot-1.jsonl"
    assert snap.exists() and not (tmp_path / "t.snapshot-2.jsonl").exists(), proc.stderr  # once per rule
    s = load(str(snap))
    assert s.header["snapshot"].startswith("online check: stale-accepted-count-read in pid ")
    assert "at step 7" in s.header["snapshot"]
    (read,) = [e for e in s.events if e["ev"] == "acc.read"]
    assert read["req"] == "req-racy" and read["event_done"] is False
    # its copy's d2h.issue is not in the window (the program never recorded one): the finding on
    # it is inconclusive, not an error (detectors/ringcut.py)
    from pdtrace.detectors import run_all

    (f,) = run_all(s.events, s.header)
    assert f.kind == "stale-accepted-count-read" and f.severity == "inconclusive" and "e7" in f.data["ring_cut"]
    assert any(e["ev"] == "acc.read" for e in load(str(out)).events)


def test_online_check_rules():
    from pdtrace.record.online import METADATA, STALE, OnlineCheck

    oc = OnlineCheck("P")
    synced = [("acc.read", 0, "a", 1, {"row": 0, "value": 1, "event_done": False, "synced": True}),
              ("acc.read", 0, "a", 1, {"row": 0, "value": 1, "event_done": True})]
    assert oc.scan(synced) is None  # synchronized, or complete: the fixed runner
    racy = [("acc.read", 0, "b", 2, {"row": 1, "value": 2, "event": "e", "event_done": False})]
    assert oc.scan(racy)[0] == STALE and oc.scan(racy) is None  # once per process
    fixed = [("kvmeta.bind", 0, None, 3, {}), ("spec.phase", 0, None, 3, {"phase": "drafter", "edge": "begin"}),
             ("kvmeta.clear", 0, None, 3, {})]
    assert oc.scan(fixed) is None  # cleared after the drafter: vLLM PR #34529
    early = [("kvmeta.bind", 0, None, 4, {}), ("kvmeta.clear", 0, None, 4, {}),
             ("spec.phase", 0, None, 4, {"phase": "drafter", "edge": "begin"})]
    hit = oc.scan(early)
    assert hit[0] == METADATA and hit[2] == 4
    assert OnlineCheck("D").scan(early) is None  # D saves no KV: nothing lost there


def test_segments_rotate_on_a_fake_clock(tmp_path):
    from pdtrace.record.frames import frame_head

    now = [0.0]
    ring = SegmentRing(str(tmp_path), 7, 4.0, clock=lambda: now[0])
    frame = frame_head(0, 10, 0)  # a frame of 10 events (its payload does not matter here)
    for k in range(40):  # one frame a second, 40 s
        now[0] = float(k)
        ring.write(frame)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "7.pinned.pdshard" in files
    segs = [f for f in files if f != "7.pinned.pdshard"]
    assert 4 <= len(segs) <= 6  # 4 s window, 1 s segments: the window plus the one being written
    assert ring.discarded == 10 * (40 - sum(os.path.getsize(tmp_path / f) // len(frame) for f in segs))
    ring.close()


def test_a_merge_of_flight_recorder_traces_is_one_too(tmp_path):
    """Seen on the GPU run of 2026-11-25 (docs/live-gpu.md): live_cpu_pd.py merged P's and D's
    `record --ring 20` traces and the merged header had lost ring_s, so check would have given
    cut findings as verdicts. A ring trace merged with a plain one keeps the window."""
    proc, ring = _record(tmp_path, "1")
    assert proc.returncode == 0, proc.stderr
    plain = tmp_path / "plain.jsonl"
    p = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(plain), "--", sys.executable, APP, "1"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PDTRACE_HOOKS="0"))
    assert p.returncode == 0, p.stderr
    merged = tmp_path / "merged.jsonl"
    m = subprocess.run([sys.executable, "-m", "pdtrace", "merge", str(plain), str(ring), "-o", str(merged)],
                       capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stderr
    h = load(str(merged)).header
    assert h["origin"] == "merge" and h["ring_s"] == 0.6
    assert [x.get("ring_s") for x in h["merged_from"]] == [None, 0.6]
    assert "ring_s" not in load(str(plain)).header
