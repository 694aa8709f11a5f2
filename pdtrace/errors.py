"""One error type for the user, one exit path (see pdtrace.cli.main).

Exit codes shared by every command (README, "Commands"):

- 0 ok; 1 findings (``check``); 4 no findings but some bug class undecided (``check``);
- 2 unusable input, bad arguments, an output that cannot be written: one line on stderr,
  naming the file (and line) where there is one;
- 3 a bug in pdtrace itself: one "please report" line, the traceback in a log file;
- ``record`` exits with the recorded command's code (127: it could not be started).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Exit codes shared by every command.
EXIT_OK = 0
EXIT_FINDINGS = 1  # `check`: the trace shows at least one finding
EXIT_UNUSABLE = 2  # bad input: unreadable / corrupt / newer-schema trace, bad arguments
EXIT_INTERNAL = 3  # a bug in pdtrace itself ("please report")
EXIT_NOT_CHECKED = 4  # `check`: no findings, but at least one bug class could not be decided


def write_stdout(text: str) -> None:
    """Write a command's report to stdout. A reader that closed the pipe early (``| head``,
    ``| grep -q``) had what it wanted: the rest goes to /dev/null and the command keeps its
    own exit code (for ``check``, the verdict), instead of click's exit 1 on EPIPE."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's last flush lands there too)
        os.close(devnull)


class PdtraceError(Exception):
    """An error meant for the user: printed without a traceback, exits with ``exit_code``."""

    exit_code = EXIT_UNUSABLE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class TraceError(PdtraceError):
    """A trace file cannot be read as asked. ``line`` is 1-based (0 = the file as a whole).

    ``damaged`` is True for a problem on one line of an otherwise readable trace (a cut
    last line, a corrupt line, a wrong-typed field): ``--lenient`` skips such lines, and
    the CLI says so."""

    def __init__(self, path: str, line: int, reason: str, *, damaged: bool | None = None):
        self.path = path
        self.line = line
        self.reason = reason
        self.damaged = line > 1 if damaged is None else damaged
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason}", EXIT_UNUSABLE)


def os_error_line(exc: OSError) -> str:
    """One line for an OSError: what failed, on which file ("disk full" spelled out)."""
    what = exc.strerror or str(exc) or type(exc).__name__
    names = [n for n in (exc.filename, getattr(exc, "filename2", None)) if n]
    where = " -> ".join(str(n) for n in names)
    return f"{where}: {what}" if where else what


def internal_error(exc: BaseException, argv: list[str] | None = None) -> int:
    """A bug in pdtrace: write the traceback to a log file, print one line, EXIT_INTERNAL.

    The log goes to ``$PDTRACE_CRASH_DIR`` (default: the temp dir). ``PDTRACE_TRACEBACK=1``
    also prints the traceback (for pdtrace's own developers)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    from . import __version__

    head = (f"pdtrace {__version__}, python {sys.version.split()[0]}, "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\nargv: {' '.join(argv if argv is not None else sys.argv)}\n\n")
    log = None
    try:
        fd, log = tempfile.mkstemp(prefix="pdtrace-crash-", suffix=".log",
                                   dir=os.environ.get("PDTRACE_CRASH_DIR") or None)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(head + text)
    except OSError:
        log = None
    where = f"traceback in {log}" if log else "traceback could not be saved (set PDTRACE_TRACEBACK=1 to print it)"
    summary = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
    print(f"pdtrace: internal error ({summary}); this is a bug in pdtrace, please report it "
          f"with the {where}", file=sys.stderr)
    if os.environ.get("PDTRACE_TRACEBACK"):
        print(text, file=sys.stderr, end="")
    return EXIT_INTERNAL


def check_writable(out: Path) -> None:
    """Fail before reading anything when the output could not be written (check -o, merge -o)."""
    parent = out.parent if str(out.parent) else Path(".")
    why = ("is a directory" if out.is_dir() else "no such directory" if not parent.is_dir()
           else "no write permission" if not os.access(parent, os.W_OK)
           or (out.exists() and not os.access(out, os.W_OK)) else None)
    if why:
        raise PdtraceError(f"cannot write the output {out}: {why}")
