"""`pdtrace record -- CMD ...`: run CMD unmodified with hooks in every Python process it starts."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ..record.bootstrap.runtime import BOOTSTRAP_DIR
from ..errors import PdtraceError, os_error_line
from ..record.redact import mask_argv
from ..record.shards import finalize_session, shard_files


def _in_terminal_foreground() -> bool:
    """True when a Ctrl-C from the terminal already reaches CMD (same foreground process group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _check_output(output: Path) -> Path:
    """Make sure the trace can be written before the program starts: its directory exists
    (created if missing) and a file can be created there. Returns the directory."""
    out_dir = output.parent if str(output.parent) else Path(".")
    try:
        if output.is_dir():
            raise PdtraceError(f"{output}: is a directory; give a file name for the trace (-o)")
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = Path(str(output) + ".tmp")
        with open(probe, "ab"):
            pass
        probe.unlink()
    except OSError as exc:
        raise PdtraceError(f"{output}: cannot write the trace there: {os_error_line(exc)}; "
                           "nothing was run") from None
    return out_dir


def _alive_shard_writers(shard_dir: str, exclude: set[int]) -> list[int]:
    """Pids of processes of this recording (one shard each, named by pid) still running.
    On Linux a pid counts only while it holds its shard open (a reused pid, a zombie do not)."""
    alive = []
    for f in shard_files(shard_dir):
        stem = os.path.basename(f).split(".")[0]
        if not stem.isdigit() or int(stem) in exclude:
            continue
        pid = int(stem)
        fd_dir = f"/proc/{pid}/fd"
        if os.path.isdir("/proc/self/fd"):
            try:
                target = os.path.realpath(f)
                if any(os.path.realpath(os.path.join(fd_dir, fd)) == target for fd in os.listdir(fd_dir)):
                    alive.append(pid)
            except OSError:  # gone, or not ours to look at
                pass
            continue
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            alive.append(pid)
    return sorted(set(alive))  # (ring mode: several shard files per pid)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return " ".join(" ".join(mask_argv(fh.read().decode(errors="replace").split("\0")[:-1])).split())[:120]
    except OSError:
        return "?"


def _wait_for_orphans(shard_dir: str, wait: float, flush_interval: float, exclude: set[int]) -> list[int]:
    """Wait up to ``wait`` seconds for every process that opened a shard in this recording
    (daemonized or orphaned workers outlive CMD) to exit; returns those still running."""
    deadline = time.monotonic() + max(0.0, wait)
    alive = _alive_shard_writers(shard_dir, exclude)
    if alive:
        print(f"pdtrace: waiting up to {wait:g}s for {len(alive)} process(es) of this recording still running "
              f"(pid {', '.join(map(str, alive))}; --orphan-wait sets how long)", file=sys.stderr)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = _alive_shard_writers(shard_dir, exclude)
    time.sleep(min(0.5, 2 * flush_interval))  # a writer that just exited flushed; one that did not, once more
    return alive


def run(cmd: list[str], output: Path, no_redact: bool = False, instance: str | None = None,
        keep_shards: bool = False, flush_interval: float = 0.2, orphan_wait: float = 10.0,
        ring: float | None = None, kv_checksum: bool = False, kv_checksum_every: int | None = None) -> int:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise PdtraceError("nothing to record: give a command after --, e.g. pdtrace record -- vllm serve MODEL")
    if ring is not None and not ring > 0:  # before anything is created (no empty shard folder left behind)
        raise PdtraceError(f"--ring {ring:g}: the window must be a positive number of seconds")
    if not flush_interval > 0:
        raise PdtraceError(f"--flush-interval {flush_interval:g}: must be a positive number of seconds")
    if kv_checksum_every is not None and kv_checksum_every < 1:
        raise PdtraceError(f"--kv-checksum-every {kv_checksum_every}: must be 1 or more (one request in N)")
    if orphan_wait < 0:
        raise PdtraceError(f"--orphan-wait {orphan_wait:g}: must be zero or more seconds")
    output = Path(output)
    created = not (output.parent if str(output.parent) else Path(".")).exists()
    out_dir = _check_output(output)
    if created:
        print(f"pdtrace: created {out_dir} for the trace", file=sys.stderr)
    session = uuid.uuid4().hex[:12]
    try:
        shard_dir = tempfile.mkdtemp(prefix=f".pdtrace-{session}-", dir=str(out_dir))
    except OSError as exc:
        raise PdtraceError(f"{out_dir}: cannot create the shard directory: {os_error_line(exc)}; "
                           "nothing was run") from None

    env = os.environ.copy()
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PDTRACE_SESSION_DIR"] = os.path.abspath(shard_dir)
    env["PDTRACE_SESSION"] = session
    env["PDTRACE_REDACT"] = "0" if no_redact else "1"
    env["PDTRACE_FLUSH"] = str(flush_interval)
    if instance:
        env["PDTRACE_INSTANCE"] = instance
    if kv_checksum or kv_checksum_every:  # digests of the transferred blocks on P and D (hooks/kv_digest.py)
        env["PDTRACE_KV_CHECKSUM"] = "1"
        env["PDTRACE_KV_CHECKSUM_EVERY"] = str(kv_checksum_every or 1)
    if ring is not None:
        env["PDTRACE_RING"] = str(ring)
        env["PDTRACE_RECORD_PID"] = str(os.getpid())  # online checks ask this process for snapshots

    recover = f"pdtrace merge {shlex.quote(shard_dir)} -o {shlex.quote(str(output))}"
    print(f"pdtrace: recording {' '.join(mask_argv(cmd))}", file=sys.stderr)
    print(f"pdtrace: shards go to {shard_dir} (if pdtrace itself is killed: {recover})", file=sys.stderr)
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        shutil.rmtree(shard_dir, ignore_errors=True)
        raise PdtraceError(f"cannot start {cmd[0]!r}: {exc.strerror or exc}", 127) from None

    forwarded: list[int] = []

    def forward(signum, frame):  # noqa: ARG001
        if signum == signal.SIGINT and _in_terminal_foreground():
            return  # the terminal already delivered it to CMD's process group
        forwarded.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    snaps: list[int] = []
    if ring is not None:  # flight recorder: SIGUSR1 writes what the window holds now
        old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda signum, frame: snaps.append(signum))
        print(f"pdtrace: flight recorder: keeping about the last {ring:g} s per process; "
              f"`kill -USR1 {os.getpid()}` writes a snapshot trace now"
              + ("; so does the first racy accepted-count read or early metadata clear (online checks)"
                 if os.environ.get("PDTRACE_ONLINE_CHECK", "1") != "0" else ""), file=sys.stderr)
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.2 if ring is not None else None)
                break
            except subprocess.TimeoutExpired:
                while snaps:
                    snaps.pop()
                    _snapshot(shard_dir, output, cmd, no_redact, ring)
            except KeyboardInterrupt:  # pragma: no cover - handler above replaces SIGINT
                continue
        still = _wait_for_orphans(shard_dir, orphan_wait, flush_interval, exclude={os.getpid()})
        if ring is not None:
            from ..record.online import take_triggers

            for d in take_triggers(shard_dir):  # fired after the last snapshot: the exit trace holds them
                print(f"pdtrace: online check in pid {d.get('pid')} at step {d.get('step')}: {d.get('reason')} "
                      "(in the trace written at exit)", file=sys.stderr)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    exit_code = rc if rc >= 0 else 128 - rc  # killed by signal N -> 128+N, like a shell
    for pid in still:
        print(f"pdtrace: warning: pid {pid} ({_cmdline(pid)}) is still running after {orphan_wait:g}s: "
              "its later events are not in the trace (it shows as incomplete)", file=sys.stderr)

    t0 = time.monotonic()
    if not shard_files(shard_dir):  # no process of CMD started a recorder
        print(f"pdtrace: no trace written: no process of {cmd[0]!r} recorded anything. pdtrace records the "
              "Python processes that can import it: run the command with the Python of the environment "
              "where pdtrace is installed (e.g. the venv's vllm), or install pdtrace there; a "
              "'not recording pid ...' line above says why a process could not.", file=sys.stderr)
        if not keep_shards:
            shutil.rmtree(shard_dir, ignore_errors=True)
        return exit_code
    try:
        footer, problems = finalize_session(shard_dir, str(output), cmd=mask_argv(cmd), redacted=not no_redact,
                                            exit_code=exit_code, ring_s=ring)
    except PdtraceError as exc:
        print(f"pdtrace: no trace written: {exc}", file=sys.stderr)
        if not keep_shards:
            shutil.rmtree(shard_dir, ignore_errors=True)
        return exit_code
    except Exception as exc:  # disk full, or a bug in the merge: the shards hold the recording
        why = os_error_line(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        print(f"pdtrace: error: could not write {output}: {why}; the recording is kept in {shard_dir}; "
              f"recover it with: {recover}", file=sys.stderr)
        return exit_code
    procs = footer["processes"]
    print(f"pdtrace: wrote {output} ({footer['events']} events from {len(procs)} processes, "
          f"{footer['dropped']} dropped, {sum(footer['hook_errors'].values())} hook errors, "
          + (f"{footer.get('ring_discarded', 0)} older than the {ring:g} s window discarded, " if ring else "")
          + f"{time.monotonic() - t0:.1f}s to merge)", file=sys.stderr)
    for p in problems:
        print(f"pdtrace: warning: {p}", file=sys.stderr)
    if keep_shards:
        print(f"pdtrace: shards kept in {shard_dir}", file=sys.stderr)
    else:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return exit_code


_snapshot_count = 0


def _snapshot(shard_dir: str, output: Path, cmd: list[str], no_redact: bool, ring: float) -> None:
    """Write the flight recorder's window as a trace while CMD runs (SIGUSR1): the shard files
    are copied (cut to whole frames) and merged; CMD and its recorders go on untouched."""
    from ..record.online import take_triggers
    from ..record.ring import copy_for_snapshot

    global _snapshot_count
    trig = take_triggers(shard_dir)  # online checks that asked for this snapshot (pdtrace.record.online)
    why = "SIGUSR1"
    if trig:
        first = min(trig, key=lambda d: d.get("t", 0))
        why = (f"online check: {first['rule']} in pid {first['pid']} at step {first.get('step')}: {first['reason']}"
               + (f" (+{len(trig) - 1} more)" if len(trig) > 1 else ""))
    _snapshot_count += 1
    name = output.name
    stem, ext = (name[:-10], ".jsonl.zst") if name.endswith(".jsonl.zst") else \
        ((name[:-6], ".jsonl") if name.endswith(".jsonl") else (name, ""))
    path = output.with_name(f"{stem}.snapshot-{_snapshot_count}{ext}")
    tmp = tempfile.mkdtemp(prefix=".pdtrace-snapshot-", dir=str(output.parent))
    try:
        if not copy_for_snapshot(shard_dir, tmp):
            print("pdtrace: snapshot: nothing recorded yet", file=sys.stderr)
            return
        footer, _problems = finalize_session(tmp, str(path), cmd=mask_argv(cmd), redacted=not no_redact,
                                             exit_code=None, ring_s=ring, snapshot=why)
        print(f"pdtrace: snapshot {path} ({footer['events']} events; {why}; the command goes on)", file=sys.stderr)
    except Exception as exc:  # a snapshot must never end the recording
        print(f"pdtrace: snapshot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
