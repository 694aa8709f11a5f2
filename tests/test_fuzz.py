"""Seeded fuzzing of the readers (issue 20): >= 2,000 mutants of the sample traces through
check / info / report and the TUI loader. Zero tracebacks: every mutant ends with an exit
code from the documented set (0, 1, 2, 4) -- 3 would be a pdtrace bug ("please report").

The commands run in-process through ``pdtrace.cli.run_cli`` (the console script's own
error path), not as 2,000 subprocesses; the TUI loader is what ``pdtrace view`` runs before
drawing: ``open_source``, the index scan, the detectors over the indexed events, and the
panes' model functions for the first requests and steps."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import orjson
import pytest

from pdtrace.cli import run_cli
from pdtrace.errors import PdtraceError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "pdtrace/samples/demo_lookahead_misalignment.jsonl",
           ROOT / "sample_traces/stale_read_rowmoves_buggy.jsonl",
           ROOT / "sample_traces/metadata_cleared_before_drafter_buggy.jsonl",
           ROOT / "sample_traces/dflash_window_buggy.jsonl"]
SEED = 20
MUTANTS = 2000
ALLOWED = {0, 1, 2, 4}
ODD_VALUES = [None, True, False, 0, -1, 2 ** 70, 1.5, "", "x", [], {}, [["a"]], [None], {"a": "b"}, [[1, -2], "3"]]


def _set_random_field(rng: random.Random, line: bytes) -> bytes:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line
    if not isinstance(obj, dict) or not obj:
        return line
    key = rng.choice(list(obj))
    r = rng.random()
    if r < 0.15:
        del obj[key]
    elif r < 0.4 and isinstance(obj[key], list) and obj[key]:  # a wrong type one level down
        v = obj[key]
        i = rng.randrange(len(v))
        if isinstance(v[i], list) and v[i] and rng.random() < 0.6:
            v[i][rng.randrange(len(v[i]))] = rng.choice(ODD_VALUES)
        else:
            v[i] = rng.choice(ODD_VALUES)
    elif r < 0.5 and isinstance(obj[key], dict) and obj[key]:
        obj[key][rng.choice(list(obj[key]))] = rng.choice(ODD_VALUES)
    else:
        obj[key] = rng.choice(ODD_VALUES)
    return json.dumps(obj).encode() + b"\n"  # (stdlib json: takes ints beyond 64 bits)


def mutate(rng: random.Random, data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    n = len(lines)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(13)
        i = rng.randrange(n)
        if op == 0:  # truncation
            return b"".join(lines)[: rng.randrange(len(data))]
        if op == 1:  # byte flips
            b = bytearray(lines[i])
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            lines[i] = bytes(b)
        elif op == 2:  # invalid UTF-8 inside a string
            lines[i] = lines[i].replace(b'"', b'"\xff\xfe', 1)
        elif op == 3:
            del lines[i]
            n = len(lines) or 1
            if not lines:
                return b""
        elif op == 4:
            lines.insert(i, lines[i])
        elif op == 5:
            j = rng.randrange(n)
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 6:  # garbage / binary line
            lines.insert(i, rng.choice([b"garbage\n", bytes(rng.randrange(256) for _ in range(40)) + b"\n", b"\n",
                                        b"[]\n", b"null\n", b"{}\n", b'{"ev": 5}\n', b'{"ev": ["x"]}\n', b"1 2\n"]))
        elif op == 7:  # a huge line
            lines.insert(i, b'{"ev": "mark", "label": "' + b"x" * (1 << 20) + b'"}\n')
        elif op == 8:  # schema version
            try:
                h = orjson.loads(lines[0])
                h["schema_version"] = rng.choice([0, -1, True, "2", 99, 2.5, None, 1, 2 ** 64])
                lines[0] = json.dumps(h).encode() + b"\n"
            except (orjson.JSONDecodeError, TypeError):
                pass
        elif op == 9:  # header / footer fields
            k = rng.choice((0, -1))
            lines[k] = _set_random_field(rng, lines[k])
        else:  # wrong-typed / missing event fields
            lines[i] = _set_random_field(rng, lines[i])
    return b"".join(lines)


def _tui_load(path: str) -> None:
    from pdtrace.commands.view import open_source
    from pdtrace.detectors import run_all
    from pdtrace.viewers.tui import model

    try:
        idx = open_source(path)
        idx.build()
    except PdtraceError:
        return
    try:
        run_all(list(idx.iter_events()), header=idx.header)
        for req in idx.req_names[:3]:
            model.block_map(idx, req)
            model.raw_ordinals(idx, req, None)
        for step in idx.steps_of()[:3]:
            model.accepted(idx, step)
            model.metadata(idx, step)
    finally:
        idx.close()


def test_fuzzed_traces_never_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("PDTRACE_CRASH_DIR", str(tmp_path))
    rng = random.Random(SEED)
    sources = [p.read_bytes() for p in SOURCES]
    path = tmp_path / "m.jsonl"
    failures: list[str] = []
    codes: dict[int, int] = {}
    for k in range(MUTANTS):
        data = mutate(rng, rng.choice(sources))
        path.write_bytes(data)
        which = k % 8
        argv = {0: ["check", str(path)], 1: ["check", str(path), "--lenient", "-f", "json"],
                2: ["info", str(path)], 3: ["info", str(path), "--lenient"],
                4: ["check", str(path), "--lenient", "-f", "markdown"], 5: ["check", str(path), "-f", "json"],
                6: ["report", str(path), "--lenient", "-o", str(tmp_path / "r.html")],
                7: None}[which]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if argv is None:
                try:
                    _tui_load(str(path))
                    rc = 0
                except Exception as exc:  # noqa: BLE001 - the point: no exception may escape
                    rc = -1
                    err.write(f"{type(exc).__name__}: {exc}")
            else:
                rc = run_cli(argv)
        codes[rc] = codes.get(rc, 0) + 1
        if rc not in ALLOWED or "Traceback" in err.getvalue():
            bad = tmp_path / f"mutant-{k}.jsonl"
            bad.write_bytes(data)
            failures.append(f"mutant {k} ({bad}) {argv or 'tui'}: rc {rc}: {err.getvalue().strip()[-300:]}")
    assert not failures, f"{len(failures)} of {MUTANTS} mutants crashed:\n" + "\n".join(failures[:15])
    assert codes.get(2, 0) > 100 and codes.get(0, 0) + codes.get(1, 0) > 100  # both kinds of outcome exercised
