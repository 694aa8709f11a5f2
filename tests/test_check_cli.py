"""`pdtrace check` / `pdtrace info` through the real typer app (CliRunner) and the console script."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import eventlib as E  # noqa: E402

from pdtrace.cli import app  # noqa: E402
from pdtrace.detectors import ALL_KINDS, LOOKAHEAD_MISALIGNMENT  # noqa: E402

runner = CliRunner()


@pytest.fixture
def buggy(tmp_path):
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, p_first_block=10, d_first_block=50)
    E.stale_read_scenario(b, move="swap", step=9)
    return b.write(tmp_path / "buggy.jsonl")


@pytest.fixture
def clean(tmp_path):
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, fixed=True, steps=True)
    E.metadata_scenario(b, fixed=True)
    E.window_scenario(b, fixed=True)  # every class applying to this (non-hybrid) setup has its events
    return b.write(tmp_path / "clean.jsonl")


def _run(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_clean_trace_exit_0(clean):
    r = _run("check", clean)
    assert r.exit_code == 0, r.output
    assert "no findings" in r.output
    assert "not checked" not in r.output
    assert "stale-accepted-count-read" in r.output and "does not apply" in r.output


def test_clean_but_partial_trace_exit_4(tmp_path):
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, fixed=True)  # no worker events at all
    r = _run("check", b.write(tmp_path / "p.jsonl"))
    assert r.exit_code == 4, r.output
    assert "no findings in the classes checked; 3 bug class(es) not checked" in r.output
    assert "kv-invariant                               not checked: the trace has no sched.step events" in r.output
    assert "connector-metadata-cleared-before-drafter  not checked: the trace has no drafter spec.phase" in r.output


def test_buggy_trace_exit_1_text(buggy):
    r = _run("check", buggy)
    assert r.exit_code == 1
    assert "lookahead-block-misalignment" in r.output and "stale-accepted-count-read" in r.output
    assert "D block 50 read P block 11 instead of 10" in r.output


def test_markdown_shape(buggy, tmp_path):
    out = tmp_path / "issue.md"
    r = _run("check", buggy, "--format", "markdown", "-o", str(out))
    assert r.exit_code == 1
    md = out.read_text()
    lines = md.splitlines()
    assert lines[0].startswith("## pdtrace check: 2 finding(s)")
    assert "| # | cause | severity | step | instance | request | summary |" in lines
    table_rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(table_rows) == 2
    # two mechanisms (a shifted lookahead pairing, an unsynchronized accepted-count read): two causes,
    # each with one worked example
    assert md.count("### Cause 1: ") == 1 and md.count("### Cause 2: ") == 1
    assert "### Environment" in md and "### Reproduce" in md
    for v in ("| vLLM | 0.32.0 |", "| torch | 2.13.0 |", "| nixl | 1.5.1 |", "| trace origin | synthetic |"):
        assert v in md
    # an example's data per cause and the findings table folded away (coverage in sight: 2 classes not checked)
    assert md.count("```json") == 2 and md.count("<details>") == md.count("</details>") == 3


def test_json_stable_shape_and_filters(buggy):
    r = _run("check", buggy, "--format", "json", "--only", LOOKAHEAD_MISALIGNMENT, "--what-if", "fixed-trim")
    assert r.exit_code == 1
    doc = json.loads(r.output)
    assert doc["schema"] == "pdtrace-check" and doc["version"] == 1
    assert set(doc) >= {"trace", "detectors", "request", "summary", "findings", "what_if"}
    assert doc["detectors"] == [LOOKAHEAD_MISALIGNMENT]
    assert doc["summary"]["by_kind"] == {LOOKAHEAD_MISALIGNMENT: 1}
    f = doc["findings"][0]
    assert set(f) == {"kind", "severity", "req", "step", "inst", "event_ids", "title", "explanation", "data", "cause"}
    assert [c["findings"] for c in doc["causes"]] == [[0]] and f["cause"] == 1
    (w,) = doc["what_if"]["requests"]
    assert w["groups"][0]["recorded"] == [[50, 11]] and w["groups"][0]["fixed"] == [[50, 10]]
    # the worker classes have no events in this trace: listed as not checked
    full = json.loads(_run("check", buggy, "--format", "json").output)
    # (and the KV invariant: this synthetic trace has no scheduler steps, so no read to judge)
    assert full["summary"]["not_checked"] == ["connector-metadata-cleared-before-drafter",
                                             "drafter-window-outside-allocation", "kv-invariant"]
    assert "no sched.step events" in full["coverage"]["kv-invariant"]["reason"]
    # a request id the trace does not hold is a usage error (a typo must not read as "no findings")
    # (cli.main prints a PdtraceError as one line and exits 2: tests/test_cli_errors.py)
    from pdtrace.errors import PdtraceError

    with pytest.raises(PdtraceError, match=r"request 'nobody' does not appear in the trace; none near it among its 1 request\(s\), e\.g\. r1") as ei:
        _run("check", buggy, "--format", "json", "--request", "nobody")
    assert ei.value.exit_code == 2


def test_what_if_text(buggy):
    r = _run("check", buggy, "--what-if", "fixed-trim")
    assert "recorded: 50<-11" in r.output and "fixed:    50<-10" in r.output


def test_what_if_text_wraps_at_the_terminal_width(buggy, monkeypatch):
    """With COLUMNS set (as at a terminal) the what-if lines wrap like the rest of the
    report, each under its own indent; the words are those of the unwrapped report."""
    whole = _run("check", buggy, "--what-if", "fixed-trim").output
    monkeypatch.setenv("COLUMNS", "60")
    r = _run("check", buggy, "--what-if", "fixed-trim")
    lines = r.output.splitlines()
    assert lines and max(map(len, lines)) <= 60, [ln for ln in lines if len(ln) > 60]
    wi_whole = whole[whole.index("what-if"):].split()
    wi_wrapped = r.output[r.output.index("what-if"):].split()
    assert wi_wrapped == wi_whole
    assert len(whole[whole.index("what-if"):].splitlines()) < len(r.output[r.output.index("what-if"):].splitlines())


def test_finding_headings_keep_each_label_with_its_value(monkeypatch):
    """At 60 columns a finding's heading wraps between "step N", "inst X" and "req ID",
    never inside one (a new user saw "... req" / "req-10-D"); the words are unchanged.
    Run from sample_traces/ with the bare file name: a path longer than 60 columns (CI's
    clone lives deeper than a checkout here) is itself broken across lines."""
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parent.parent / "sample_traces")
    sample = "stale_read_rowmoves_buggy.jsonl"
    whole = _run("check", sample).output
    monkeypatch.setenv("COLUMNS", "60")
    out = _run("check", sample).output
    lines = out.splitlines()
    # (a command is never wrapped, so that it can be pasted: the terminal folds it)
    assert max(len(x) for x in lines if not x.lstrip().startswith("pdtrace ")) <= 60 and "\u00a0" not in out
    heads = [i for i, ln in enumerate(lines) if ln.startswith("[")]
    assert heads and any(lines[i + 1].startswith("    req ") for i in heads)  # (it did wrap)
    for i in heads:
        assert not lines[i].rstrip().endswith((" req", " step", " inst")), lines[i]
    assert out.split() == whole.split()


@pytest.mark.parametrize("args,needle", [
    (["--only", "nope"], "valid kinds: " + ", ".join(ALL_KINDS)),
    (["--format", "yaml"], "unknown --format"),
    (["--what-if", "magic"], "unknown --what-if"),
])
def test_bad_arguments_exit_2(buggy, args, needle):
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", buggy, *args], capture_output=True, text=True)
    assert r.returncode == 2
    assert needle in r.stderr


def test_truncated_trace_names_line_and_lenient_goes_on(buggy, tmp_path):
    data = pathlib.Path(buggy).read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(data[:6]) + data[6][: len(data[6]) // 2])  # killed mid-line 7
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(cut)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{cut}:7:" in r.stderr and "truncated" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(cut), "--lenient"], capture_output=True, text=True)
    # it goes on: a verdict (1 findings, 4 some class undecided on the cut trace), not 2
    assert r.returncode in (0, 1, 4) and "warning" in r.stderr and ":7:" in r.stderr


def test_corrupt_line_names_line(buggy, tmp_path):
    lines = pathlib.Path(buggy).read_bytes().splitlines(keepends=True)
    lines[3] = b"{not json\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines))
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and f"{bad}:4: corrupt line" in r.stderr


def test_not_a_trace_exit_2(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"hello": 1}\n')
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and ":1:" in r.stderr


def test_info(buggy):
    r = _run("info", buggy)
    assert r.exit_code == 0
    assert "vllm 0.32.0" in r.output and "origin     synthetic" in r.output
    assert "nixl.request_finished" in r.output and "processes  " in r.output


def test_lenient_check_of_a_cut_trace_calls_no_class_clean(tmp_path):
    """A real trace (the live GPU V2 run: clean, every class decided) cut mid-line: with --lenient
    the events before the cut are read, but no class is called checked: exit 4, never 0."""
    from pdtrace.tracefile.compress import decompress_to

    src = pathlib.Path(__file__).parent.parent / "sample_traces" / "live_gpu_pd_eagle_v2.jsonl.zst"
    whole = tmp_path / "whole.jsonl"
    decompress_to(str(src), str(whole))
    data = whole.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: len(data) // 2])
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(cut), "--lenient", "--format", "json"],
                       capture_output=True, text=True)
    assert r.returncode == 4, r.stderr
    doc = json.loads(r.stdout)
    assert doc["trace"]["complete"] is False and not doc["findings"]
    cov = doc["coverage"]
    # (V2 keeps the counts on the device: it does not apply in what is left, but a lost config or worker
    # may say otherwise: not checked either, never "does not apply" on a cut trace, issue 49)
    st = cov["stale-accepted-count-read"]
    assert st["status"] == "not-checked" and "says it does not apply" in st["reason"]
    for k in ("lookahead-block-misalignment", "connector-metadata-cleared-before-drafter",
              "drafter-window-outside-allocation"):
        assert cov[k]["status"] == "not-checked" and "no footer" in cov[k]["reason"] and cov[k]["events"] > 0
    # the whole trace: those three checked; the KV-load class (issue 36) is not, the run was recorded
    # before its hooks existed
    full = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(src), "--format", "json"],
                          capture_output=True, text=True)
    assert full.returncode == 4
    fcov = json.loads(full.stdout)["coverage"]
    assert [k for k, c in fcov.items() if c["status"] == "not-checked"] == ["kv-load-failure-recovery"]
    assert "recorded without the hook(s) kv_load.invalid_blocks" in fcov["kv-load-failure-recovery"]["reason"]
    # the same warning lines from check and report (one wording): the cut line, then "incomplete trace"
    rep = subprocess.run([sys.executable, "-m", "pdtrace", "report", str(cut), "--lenient", "-o",
                          str(tmp_path / "r.html")], capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("pdtrace: warning:")]
    assert warn and any("incomplete trace (" in ln and "no footer" in ln for ln in warn), r.stderr
    assert [ln for ln in rep.stderr.splitlines() if ln.startswith("pdtrace: warning:")] == warn


def test_text_and_markdown_list_errors_before_warnings():
    """A trace's errors come first in the text and markdown reports (on the H200 evidence, 14
    errors were numbered among 79 warnings in step order); JSON keeps (step, kind)."""
    from pdtrace.commands.check import by_severity
    from pdtrace.detectors.base import Finding

    def f(sev, step):
        return Finding("stale-accepted-count-read", sev, f"r{step}", step, "D", [step], f"{sev} at {step}", "x")

    found = [f("warning", 1), f("inconclusive", 2), f("error", 3), f("warning", 4), f("error", 5)]
    assert [(x.severity, x.step) for x in by_severity(found)] == [
        ("error", 3), ("error", 5), ("warning", 1), ("warning", 4), ("inconclusive", 2)]
    trace = pathlib.Path(__file__).resolve().parent.parent / "sample_traces" / "stale_read_rowmoves_buggy.jsonl"
    text = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(trace)], capture_output=True, text=True).stdout
    heads = [ln.split()[1] for ln in text.splitlines() if ln.startswith("[")]
    assert heads and heads == sorted(heads, key=["ERROR", "WARNING", "INCONCLUSIVE"].index), heads


def test_a_cut_trace_never_says_a_class_does_not_apply(tmp_path):
    """Issue 49: the stale-read sample cut at line 90 of 160 (P's and D's first scheduler configs
    read, the hybrid D's config after the cut): the class is not checked, never "does not apply",
    where the whole file has 17 findings of it."""
    src = pathlib.Path(__file__).parent.parent / "sample_traces" / "stale_read_rowmoves_buggy.jsonl"
    lines = src.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:90]))
    doc = json.loads(subprocess.run([sys.executable, "-m", "pdtrace", "check", str(cut), "--lenient", "-f", "json"],
                                    capture_output=True, text=True).stdout)
    st = doc["coverage"]["stale-accepted-count-read"]
    assert st["status"] == "not-checked" and "may say otherwise" in st["reason"]
    whole = json.loads(subprocess.run([sys.executable, "-m", "pdtrace", "check", str(src), "-f", "json"],
                                      capture_output=True, text=True).stdout)
    assert whole["summary"]["by_kind"] == {"stale-accepted-count-read": 17}

