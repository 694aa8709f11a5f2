"""`pdtrace info` answers from the header and footer alone when the footer is intact
(constant time, issue 22), reads everything with --full or without a footer, and names each
input's command for a merged trace."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from pdtrace import cli
from pdtrace.commands import info as info_cmd
from pdtrace.tracefile.ends import read_ends
from pdtrace.merge import merge_traces

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "pdtrace/samples/demo_lookahead_misalignment.jsonl"


def _info(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.run_cli(["info", *map(str, args)])
    return rc, out.getvalue(), err.getvalue()


def test_info_reads_only_the_ends_of_a_trace_with_a_footer(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("info read the events of a trace with an intact footer")
    monkeypatch.setattr(info_cmd, "read_through", no_load)
    rc, out, _ = _info(SAMPLE)
    footer = json.loads(SAMPLE.read_text().splitlines()[-1])
    assert rc == 0 and f"events     {footer['events']}\n" in out
    assert "footer intact; the events were not read: --full reads them" in out
    for kind, n in footer["counts"].items():
        assert f"{n:>9}  {kind}" in out


def test_full_reads_the_events_and_finds_what_the_footer_cannot_say(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    lines[5] = "{not json"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    rc, out, _ = _info(bad)  # the ends are intact: answered from them
    assert rc == 0 and "events were not read" in out
    rc, out, err = _info(bad, "--full")  # info reads past damage: it names the line and says so
    assert rc == 0 and f"{bad}:6" in err and "complete   NO" in out and "Traceback" not in err


def test_a_trace_without_a_footer_is_read_in_full(tmp_path):
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(SAMPLE.read_bytes()[:3000])
    assert read_ends(str(cut))[1] is None
    rc, out, err = _info(cut)  # (the command for looking at a broken file does not demand --lenient)
    assert rc == 0 and "no newline at end of file" in err and "summary rebuilt from the events" in out
    rc, out2, err = _info(cut, "--lenient")
    assert rc == 0 and out2 == out


def test_read_ends_finds_a_footer_longer_than_one_read(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    footer = json.loads(lines[-1])
    footer["processes"] = footer["processes"] * 3000  # ~300 KB: several backward reads
    lines[-1] = json.dumps(footer)
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines) + "\n")
    header, got, size = read_ends(str(big))
    assert got == footer and size == big.stat().st_size and header["ev"] == "trace.header"


def test_merged_trace_names_each_inputs_command(tmp_path):
    out = tmp_path / "m.jsonl"
    merge_traces([SAMPLE, SAMPLE], str(out))
    rc, text, _ = _info(out)
    cmd = " ".join(json.loads(SAMPLE.read_text().splitlines()[0])["cmd"])
    assert rc == 0 and text.count(f"{SAMPLE.name}: {cmd}") == 2


def test_a_newer_schema_is_refused_as_check_refuses_it(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    head = json.loads(lines[0])
    head["schema_version"] += 1
    newer = tmp_path / "newer.jsonl"
    newer.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    rc, out, err = _info(newer)
    assert rc == 2 and not out and f"newer.jsonl:1: trace schema_version {head['schema_version']} is newer" in err
    rc, out, _ = _info(newer, "--lenient")
    assert rc == 0 and f"v{head['schema_version']}" in out
