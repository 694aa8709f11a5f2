"""`pdtrace bundle TRACE -o bug.tar.gz|bug.zip`: everything a bug report needs, in one archive.

Contents (under ``pdtrace-bug/``): the trace, ``check.md`` (``pdtrace check --format
markdown``), ``report.html`` (``pdtrace report``), ``doctor.txt`` (``pdtrace doctor`` run
here), ``versions.json`` (versions in the trace header and on this machine) and
``README.txt`` saying what each file is. A trace recorded with ``--no-redact`` (header
``redacted: false``, or token ids present) is refused unless ``--allow-unredacted``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

from ..errors import EXIT_UNUSABLE, PdtraceError

ROOT = "pdtrace-bug"


def _archive_kind(output: Path) -> str:
    name = output.name.lower()
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar.gz", ".tgz")):
        return "tar.gz"
    raise PdtraceError(f"cannot tell the archive format from {output.name!r}: use a .tar.gz, .tgz or .zip name")


def _captured(fn: Callable[[], Any]) -> tuple[str, str]:
    """Run fn with stdout/stderr captured. Returns (output, status line); never raises."""
    out, err = io.StringIO(), io.StringIO()
    status = ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = fn()
        status = f"exit code {rc if isinstance(rc, int) else 0}"
    except PdtraceError as exc:
        status = f"error (exit code {exc.exit_code}): {exc}"
    except SystemExit as exc:
        status = f"exit code {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - an optional part failing must not lose the bundle
        if isinstance(exc, KeyboardInterrupt):
            raise
        status = f"failed: {type(exc).__name__}: {exc}"
    text = out.getvalue()
    if err.getvalue().strip():
        text += ("\n" if text and not text.endswith("\n") else "") + "--- stderr ---\n" + err.getvalue()
    return text, status


def _doctor() -> str:
    try:
        from . import doctor
    except ImportError as exc:
        return f"pdtrace doctor is not available in this pdtrace ({exc}).\n"
    text, status = _captured(lambda: doctor.run(json_out=False))
    return f"$ pdtrace doctor   ({status})\n\n{text}"


def _check_md(trace: Path, dest: Path, lenient: bool) -> str:
    try:
        from . import check
    except ImportError as exc:
        dest.write_text(f"pdtrace check is not available ({exc}).\n", encoding="utf-8")
        return "unavailable"
    text, status = _captured(lambda: check.run(trace=trace, format="markdown", only=[], request=None,
                                               what_if=None, output=dest, lenient=lenient))
    if not dest.exists():
        dest.write_text(f"pdtrace check --format markdown did not produce a report: {status}\n\n{text}",
                        encoding="utf-8")
    return status


def _versions(header: dict[str, Any]) -> dict[str, Any]:
    from ..tracefile.versions import collect_versions

    return {"trace": dict(header.get("versions") or {}), "trace_pdtrace": header.get("pdtrace", ""),
            "trace_origin": header.get("origin", ""), "trace_created": header.get("created", ""),
            "here": collect_versions(), "platform": platform.platform(), "python": sys.version.split()[0]}


def _causes(findings: list, tr: Any) -> list:
    """The root causes, numbered as `pdtrace check` numbers them."""
    from ..detectors import by_severity
    from ..detectors.causes import group, trace_locations

    return group(by_severity(findings), trace_locations(tr.events, tr.header))


def _cause_lines(causes: list, tr: Any) -> list[str]:
    """The root causes (as `pdtrace check` names them), one line each."""
    from ..detectors.causes import header_vllm, where_text

    vllm = header_vllm(tr.header)
    out = []
    for c in causes:
        out.append(f"cause {c.n}: {c.severity.upper()} {c.kind}: {c.title} ({c.counts_text()})"
                   + (f"; in vLLM {vllm}: {where_text(c)}" if c.where else "")
                   + (f"; upstream: {', '.join(c.upstream)}" if c.upstream else ""))
    return out


def _repro_tests(tr: Any, causes: list, d: Path, trace_name: str, findings: list) -> list[str]:
    """``pdtrace repro --cause N`` for each root cause it can rebuild: test_cause_N.py (pytest and vLLM alone)."""
    from ..detectors import by_severity
    from .repro_standalone import for_cause

    ordered = by_severity(findings)  # (the list the causes index)
    out = []
    for c in causes:
        try:
            text = for_cause(tr.events, tr.header, c, trace_name, ordered)
        except PdtraceError:
            continue  # (not rebuilt yet: README.txt's causes and check.md say what it is)
        (d / f"test_cause_{c.n}.py").write_text(text, encoding="utf-8")
        out.append(f"test_cause_{c.n}.py")
    return out


def _readme(trace_name: str, header: dict[str, Any], check_status: str, n_findings: int, note: str,
            zst: bool = False, causes: list[str] | None = None, lenient: str = "") -> str:
    import textwrap

    what = ("JSON Lines compressed with zstd: `zstd -dc` or `zstdcat` it for `head` / `jq`; pdtrace reads it "
            "as it is" if zst else "JSON Lines")
    said = "\n".join(ln for c in (causes or []) for ln in textwrap.wrap(c, 90, subsequent_indent="    ", break_on_hyphens=False, break_long_words=False))
    # (a trace name longer than the Files column gets a line of its own)
    name_col = f"{trace_name:<16}" if len(trace_name) <= 16 else f"{trace_name}\n{'':<16}"
    return _fold(f"""pdtrace bug-report bundle
=========================

Made {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `pdtrace bundle` from the trace {trace_name}
(origin: {header.get('origin', '?')}, recorded {header.get('created', '?')}, redacted: {header.get('redacted')}).

Root causes ({len(causes or [])}; `pdtrace check {trace_name}{lenient}` says the same, check.md in full)
-----------
{said or "none: no findings"}

Files
-----
{name_col} the pdtrace trace itself ({what}: header line, events, footer line;
                 format: docs/trace-format.md). Re-run everything below from it.
check.md         `pdtrace check --format markdown` on the trace: the findings, ready to
                 paste into a GitHub issue ({check_status}).
report.html      `pdtrace report`: a self-contained Plotly report (open it in a browser,
                 works offline): findings, timeline of P/D steps with KV transfers,
                 block maps, accepted-count reads, connector-metadata phases
                 ({n_findings} finding(s){'; ' + note if note else ''}).
doctor.txt       `pdtrace doctor` run on the machine that made this bundle: which pdtrace
                 hooks apply to the vLLM installed there (it says so when vLLM is absent;
                 that machine may not be the one that recorded the trace).
versions.json    vLLM / torch / NIXL / Python versions from the trace header ("trace")
                 and on the machine that made this bundle ("here").
README.txt       this file.
test_cause_N.py  for each root cause `pdtrace repro --cause N` can rebuild (lookahead
                 blocks, the DFlash window, a KV-load rollback, failed blocks shared
                 through the prefix cache, a KV load into blocks a step in flight writes
                 or reads, the drafter's KV cache group left out of the transfer, an
                 accepted count read after row moves, so far): the regression
                 test a fix lands with; runs with pytest and vLLM alone (`python -m pytest
                 test_cause_N.py`), fails where the bug is.

To look at it yourself: `pdtrace check {trace_name}{lenient}`, `pdtrace view {trace_name}`,
`pdtrace export {trace_name} --perfetto out.json` (open in https://ui.perfetto.dev).
""")


def _fold(text: str, width: int = 90) -> str:
    """Lines over ``width`` wrapped at spaces, continuing at their own indent (URLs and paths kept whole)."""
    import textwrap

    out = []
    for ln in text.split("\n"):
        if len(ln) <= width:
            out.append(ln)
            continue
        indent = ln[:len(ln) - len(ln.lstrip())]
        out += textwrap.wrap(ln, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)
    return "\n".join(out)


def run(trace: Path, output: Path, allow_unredacted: bool = False, lenient: bool = False) -> int:
    from ..viewers.html import report as html_report
    from .report import load_with_findings

    trace, output = Path(trace), Path(output)
    kind = _archive_kind(output)
    tr, findings, note = load_with_findings(trace, lenient)
    unredacted = tr.header.get("redacted") is False
    has_ids = any("prompt_ids" in e for e in tr.events)
    if (unredacted or has_ids) and not allow_unredacted:
        why = "its header says redacted: false (recorded with --no-redact)" if unredacted else \
            "it contains prompt token ids (prompt_ids)"
        raise PdtraceError(
            f"refusing to bundle {trace}: {why}, so it may contain prompt token ids that reveal user "
            f"prompts. Re-record without --no-redact, or pass --allow-unredacted if the bundle stays private.",
            EXIT_UNUSABLE)

    from ..tracefile.compress import is_zstd

    zst = is_zstd(str(trace))  # (named for what it is: `head` / `jq` on a .jsonl that is zstd get binary)
    ext = ".jsonl.zst" if zst else ".jsonl"
    trace_name = trace.name if trace.name.endswith(ext) else "trace" + ext
    with tempfile.TemporaryDirectory(prefix="pdtrace-bundle-") as tmp:
        d = Path(tmp) / ROOT
        d.mkdir()
        shutil.copyfile(trace, d / trace_name)
        check_status = _check_md(trace, d / "check.md", lenient)
        try:
            html_report.write(tr, d / "report.html", findings, findings_note=note)
        except Exception as exc:  # noqa: BLE001 - keep the rest of the bundle
            (d / "report.html").write_text(f"<!DOCTYPE html><p>report failed: {type(exc).__name__}: {exc}</p>",
                                           encoding="utf-8")
        (d / "doctor.txt").write_text(_doctor(), encoding="utf-8")
        (d / "versions.json").write_text(json.dumps(_versions(tr.header), indent=2) + "\n", encoding="utf-8")
        causes = _causes(findings, tr)
        (d / "README.txt").write_text(_readme(trace_name, tr.header, check_status, len(findings), note, zst,
                                              _cause_lines(causes, tr), " --lenient" if lenient else ""),
                                      encoding="utf-8")
        names = [trace_name, "check.md", "report.html", "doctor.txt", "versions.json", "README.txt"]
        names += _repro_tests(tr, causes, d, trace_name, findings)
        part = output.with_name(output.name + ".part")
        try:
            if kind == "zip":
                with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
                    for n in names:
                        zf.write(d / n, f"{ROOT}/{n}")
            else:
                with tarfile.open(part, "w:gz", compresslevel=6) as tf:
                    for n in names:
                        tf.add(d / n, f"{ROOT}/{n}")
            os.replace(part, output)
        except OSError as exc:
            with contextlib.suppress(OSError):
                part.unlink()
            raise PdtraceError(f"cannot write {output}: {exc.strerror or exc}") from None
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB): {', '.join(names)}; "
          f"{len(findings)} finding(s)", file=sys.stderr)
    if unredacted or has_ids:
        print("pdtrace: warning: the bundle holds an UNREDACTED trace (--allow-unredacted); do not post it publicly",
              file=sys.stderr)
    return 0
