"""`pdtrace record -- CMD ...`: run CMD unmodified with hooks in every Python process it starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ..bootstrap.runtime import BOOTSTRAP_DIR
from ..errors import PdtraceError
from ..redact import mask_argv
from ..shards import finalize_session


def _in_terminal_foreground() -> bool:
    """True when a Ctrl-C from the terminal already reaches CMD (same foreground process group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def run(cmd: list[str], output: Path, no_redact: bool = False, instance: str | None = None,
        keep_shards: bool = False, flush_interval: float = 0.2) -> int:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise PdtraceError("nothing to record: give a command after --, e.g. pdtrace record -- vllm serve MODEL")
    output = Path(output)
    out_dir = output.parent if str(output.parent) else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    session = uuid.uuid4().hex[:12]
    shard_dir = tempfile.mkdtemp(prefix=f".pdtrace-{session}-", dir=str(out_dir))

    env = os.environ.copy()
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PDTRACE_SESSION_DIR"] = os.path.abspath(shard_dir)
    env["PDTRACE_SESSION"] = session
    env["PDTRACE_REDACT"] = "0" if no_redact else "1"
    env["PDTRACE_FLUSH"] = str(flush_interval)
    if instance:
        env["PDTRACE_INSTANCE"] = instance

    print(f"pdtrace: recording {' '.join(mask_argv(cmd))}", file=sys.stderr)
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
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - handler above replaces SIGINT
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    exit_code = rc if rc >= 0 else 128 - rc  # killed by signal N -> 128+N, like a shell

    time.sleep(min(0.5, 2 * flush_interval))  # let orphaned children's writers flush once more
    t0 = time.monotonic()
    try:
        footer, problems = finalize_session(shard_dir, str(output), cmd=mask_argv(cmd), redacted=not no_redact,
                                            exit_code=exit_code)
    except PdtraceError as exc:
        print(f"pdtrace: no trace written: {exc}", file=sys.stderr)
        if not keep_shards:
            shutil.rmtree(shard_dir, ignore_errors=True)
        return exit_code
    procs = footer["processes"]
    print(f"pdtrace: wrote {output} ({footer['events']} events from {len(procs)} processes, "
          f"{footer['dropped']} dropped, {sum(footer['hook_errors'].values())} hook errors, "
          f"{time.monotonic() - t0:.1f}s to merge)", file=sys.stderr)
    for p in problems:
        print(f"pdtrace: warning: {p}", file=sys.stderr)
    if keep_shards:
        print(f"pdtrace: shards kept in {shard_dir}", file=sys.stderr)
    else:
        shutil.rmtree(shard_dir, ignore_errors=True)
    return exit_code
