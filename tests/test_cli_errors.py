"""One error path for the whole CLI (issue 20): usage errors, unreadable input and
unwritable output give one line on stderr and exit 2; a bug in pdtrace gives one
"please report" line with the traceback in a log file and exit 3; never a bare traceback.

Run through the real console entry (``python -m pdtrace``) where the exit code and the
stderr text are the point; in-process through ``run_cli`` for the crash-log path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrace import cli
from pdtrace.errors import EXIT_INTERNAL, EXIT_UNUSABLE

SAMPLE = str(Path(cli.__file__).parent / "samples" / "demo_lookahead_misalignment.jsonl")


def _pdtrace(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "pdtrace", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def _one_error_line(r, *needles):
    assert r.returncode == EXIT_UNUSABLE, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("pdtrace: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("args, needles", [
    (["check"], ["Missing argument 'TRACE'", "pdtrace check --help"]),
    (["bogus"], ["No such command 'bogus'"]),
    (["check", "--no-such-flag", "x"], ["No such option: --no-such-flag"]),
    (["check", "--format", "yaml", SAMPLE], ["unknown --format 'yaml'"]),
    (["check", "/nonexistent/t.jsonl"], ["/nonexistent/t.jsonl", "cannot open"]),
    (["info", __file__], [__file__ + ":1", "not a pdtrace trace"]),
    (["merge"], ["Missing argument 'INPUT'"]),
    (["view", "/nonexistent/t.jsonl"], ["/nonexistent/t.jsonl", "cannot open"]),  # the same words as check
])
def test_usage_and_input_errors_are_one_line_exit_2(args, needles):
    _one_error_line(_pdtrace(*args), *needles)


def test_version_flag():
    from pdtrace import __version__
    from pdtrace.schema import SCHEMA_VERSION

    r = _pdtrace("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pdtrace {__version__} (trace schema v{SCHEMA_VERSION})"
    assert "--version" in _pdtrace("--help").stdout


def test_bare_command_prints_help_and_exits_2():
    r = _pdtrace()
    assert r.returncode == EXIT_UNUSABLE and "Traceback" not in r.stderr
    assert "Commands" in r.stderr and "check" in r.stderr


def test_help_never_cuts_a_bug_class_name_at_its_hyphens():
    """At 80 columns click's wrapper broke `kv-never-crossed` into `kv-` / `never-crossed` (a new user could
    not copy a name from `check --help` into --only); help wraps at spaces only now."""
    from pdtrace.detectors.base import ALL_KINDS

    r = _pdtrace("check", "--help", env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0 and max(len(ln) for ln in r.stdout.splitlines()) <= 80
    words = {w.strip(",.") for w in r.stdout.split()}
    assert set(ALL_KINDS) <= words, sorted(set(ALL_KINDS) - words)


def test_damaged_trace_names_the_line_and_hints_lenient(tmp_path):
    lines = Path(SAMPLE).read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:5]) + b'{"ev": "sched.step", oops\n' + b"".join(lines[6:]))
    line = _one_error_line(_pdtrace("check", str(bad)), f"{bad}:6", "--lenient")
    assert "corrupt line" in line
    r = _pdtrace("check", str(bad), "--lenient")  # the hint is right: lenient reads it
    assert r.returncode in (0, 1, 4), r.stderr
    assert f"{bad}:6" in r.stderr


def test_unwritable_output_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = _pdtrace("check", SAMPLE, "-o", str(blocker / "out.md"))
    _one_error_line(r, str(blocker / "out.md"))


def test_internal_bug_writes_a_log_and_exits_3(tmp_path, monkeypatch, capsys):
    """A genuine bug (here: a ZeroDivisionError raised inside a command) is not shown as a
    traceback: one line says it is a pdtrace bug and where the traceback was saved."""
    import pdtrace.commands.info as info

    def broken(**_kw):
        return 1 // 0

    monkeypatch.setattr(info, "run", broken)
    monkeypatch.setenv("PDTRACE_CRASH_DIR", str(tmp_path))
    monkeypatch.delenv("PDTRACE_TRACEBACK", raising=False)
    rc = cli.run_cli(["info", SAMPLE])
    err = capsys.readouterr().err
    assert rc == EXIT_INTERNAL
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "internal error (ZeroDivisionError" in err and "please report" in err
    logs = list(tmp_path.glob("pdtrace-crash-*.log"))
    assert len(logs) == 1 and str(logs[0]) in err
    text = logs[0].read_text()
    assert "Traceback" in text and "ZeroDivisionError" in text and "argv: pdtrace info" in text


def test_cli_needs_no_click_import():
    """typer >= 0.2x no longer installs click: the CLI must not import it."""
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def no_click(name, *a, **k):\n"
            "    if name == 'click' or name.startswith('click.'):\n"
            "        raise ImportError('click is not installed')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = no_click\n"
            "from pdtrace.cli import run_cli\n"
            "sys.exit(run_cli(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "check", "--no-such-flag", "x"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ))
    assert r.returncode == EXIT_UNUSABLE, r.stderr
    assert "No such option" in r.stderr and "Traceback" not in r.stderr


def test_bad_record_options_create_nothing_and_merge_refuses_a_repeated_input(tmp_path):
    out = tmp_path / "new" / "r.jsonl"
    for opt in (["--ring", "-1"], ["--ring", "0"], ["--flush-interval", "0"], ["--orphan-wait", "-2"],
                ["--kv-checksum-every", "0"]):
        r = _pdtrace("record", "-o", str(out), *opt, "--", "true")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (opt, r.stderr)
    assert not (tmp_path / "new").exists()  # nothing created: no empty shard folder left behind
    sample = Path(SAMPLE)
    r = _pdtrace("merge", str(sample), str(sample), "-o", str(tmp_path / "m.jsonl"))
    assert r.returncode == 2 and "given twice" in r.stderr and not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("extra", [[], ["-j", "2"]])
def test_a_null_event_id_is_a_bad_line_not_a_crash(tmp_path, extra):
    """Issue 49: an event whose "id" is null made check exit 3 (sorting ids in
    detectors/index.py). It is a damaged line: strict, one line naming file:line and the field,
    exit 2; --lenient skips it and, with no finding in what is left, exits 4 (not checked)."""
    import json

    src = Path(__file__).resolve().parent.parent / "sample_traces" / "lookahead_aligned16_k1_fixed.jsonl"
    lines = src.read_text().splitlines()
    k = next(i for i, ln in enumerate(lines) if '"ev":"nixl.remote_alloc"' in ln)
    ev = json.loads(lines[k])
    ev["id"] = None
    lines[k] = json.dumps(ev)
    bad = tmp_path / "nullid.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    _one_error_line(_pdtrace("check", str(bad), *extra), f"{bad}:{k + 1}:", "'id' should be int, got null")
    r = _pdtrace("check", "--lenient", str(bad), *extra)
    assert r.returncode == 4 and "internal error" not in r.stderr and "Traceback" not in r.stderr, (r.returncode,
                                                                                                    r.stderr)
    assert f"{bad}:{k + 1}:" in r.stderr
