"""One error type for the user, one exit path (see pdtrace.cli.main)."""

from __future__ import annotations

# Exit codes shared by every command.
EXIT_OK = 0
EXIT_FINDINGS = 1  # `check`: the trace shows at least one finding
EXIT_UNUSABLE = 2  # bad input: unreadable / corrupt / newer-schema trace, bad arguments
EXIT_INTERNAL = 3  # a bug in pdtrace itself ("please report")
EXIT_NOT_CHECKED = 4  # `check`: no findings, but at least one bug class could not be decided


class PdtraceError(Exception):
    """An error meant for the user: printed without a traceback, exits with ``exit_code``."""

    exit_code = EXIT_UNUSABLE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class TraceError(PdtraceError):
    """A trace file cannot be read as asked. ``line`` is 1-based (0 = the file as a whole)."""

    def __init__(self, path: str, line: int, reason: str):
        self.path = path
        self.line = line
        self.reason = reason
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason}", EXIT_UNUSABLE)
