"""`pdtrace doctor`: which hooks apply to the vLLM installed here, which are skipped, and why.

Checks every hook of every subsystem in ``pdtrace.hooks.SUBSYSTEMS`` with
``hooks.check(spec)`` (imports the target module, resolves the attribute, compares the
signature; patches nothing), then, per bug class, which hooks feed it and whether they
fire under model runner V1 and V2, and which runner vLLM builds by default
(``pdtrace/commands/doctor_coverage.py``); with ``-- CMD``, vLLM's own choice for that server
command line and the per-class verdicts under it (``pdtrace/commands/doctor_cmdline.py``). Exit 0: all required hooks ok. 1: at least one required hook
skipped (optional hooks, for code some releases do not have, never count). 2: vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
from typing import Any

from pdtrace.tracefile.versions import collect_versions


def _rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from pdtrace import hooks

    rows: list[dict[str, Any]] = []
    broken: list[dict[str, Any]] = []
    for sub in hooks.SUBSYSTEMS:
        try:
            importlib.import_module(f"pdtrace.hooks.{sub}")
        except Exception as exc:
            broken.append({"hook": f"{sub}.*", "subsystem": sub, "target": f"pdtrace.hooks.{sub}",
                           "status": "skipped", "optional": False,
                           "reason": f"hook module failed to import: {type(exc).__name__}: {exc}"[:300]})
    for spec in hooks.REGISTRY.values():
        status, reason, form = hooks.check_form(spec)
        module, qualname = form[:2] if form else (spec.module, spec.qualname)
        rows.append({"hook": spec.name, "subsystem": spec.subsystem, "target": f"{module}:{qualname}",
                     "status": status, "optional": spec.optional, "reason": reason})
    order = {s: i for i, s in enumerate(hooks.SUBSYSTEMS)}
    rows.sort(key=lambda r: (order.get(r["subsystem"], 99), r["optional"], r["hook"]))
    return rows + broken, broken


def run(json_out: bool = False, cmd: list[str] | None = None) -> int:
    # Importing vLLM logs to stdout on some versions (0.30.0 prints INFO lines): whatever the
    # imports print goes to stderr, so `doctor --json` writes only JSON on stdout.
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return _run(json_out, out, cmd or [])


def _run(json_out: bool, out: Any, cmd: list[str]) -> int:
    versions = collect_versions()
    if importlib.util.find_spec("vllm") is None:
        msg = ("vLLM is not installed in this Python environment, so there is nothing to hook. Run doctor "
               "in the environment that runs vLLM (pip install pdtrace there; it keeps that vLLM and torch); "
               "pip install 'pdtrace[record]' installs the `vllm` wheel (CUDA) where none is installed")
        if json_out:
            print(json.dumps({"versions": versions, "error": msg, "hooks": []}, indent=2), file=out)
        else:
            print(f"pdtrace doctor: {msg}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pdtrace.commands import doctor_coverage

    rows, _broken = _rows()
    failed = [r for r in rows if r["status"] != "ok" and not r["optional"]]
    cov = doctor_coverage.class_coverage(rows)
    runner = doctor_coverage.default_runner()
    ck = doctor_coverage.checksum(rows)
    for_cmd = None
    if cmd:
        from pdtrace.commands import doctor_cmdline

        for_cmd = doctor_cmdline.evaluate(cmd)
    if json_out:
        doc = {"versions": versions, "hooks": rows, "ok": sum(r["status"] == "ok" for r in rows),
               "failed": len(failed), "coverage": cov, "model_runner": runner, "kv_checksum": ck}
        if for_cmd is not None:
            doc["command"] = {**for_cmd, "coverage": doctor_cmdline.verdicts(for_cmd, cov) if for_cmd["ok"] else None}
        print(json.dumps(doc, indent=2, default=str), file=out)
    else:
        print("pdtrace doctor", file=out)
        print("  " + "  ".join(f"{k}={v or '-'}" for k, v in versions.items()), file=out)
        print(file=out)
        w_hook = max(len(r["hook"]) for r in rows) if rows else 10
        w_tgt = min(max((len(r["target"]) for r in rows), default=10), 90)
        width = shutil.get_terminal_size((120, 24)).columns
        wide = width >= 2 + w_hook + 2 + 18 + 2 + w_tgt + 6  # (else each hook's target on a line of its own)
        if wide:
            print(f"  {'hook':<{w_hook}}  {'status':<18}  {'target':<{w_tgt}}  why", file=out)
        else:
            print(f"  {'hook':<{w_hook}}  status  why\n      target", file=out)
        for r in rows:
            st = r["status"] if r["status"] == "ok" else ("skipped (optional)" if r["optional"] else "SKIPPED")
            if wide:
                print(f"  {r['hook']:<{w_hook}}  {st:<18}  {r['target']:<{w_tgt}}  {r['reason']}", file=out)
            else:
                print(f"  {r['hook']:<{w_hook}}  {st}" + (f"  {r['reason']}" if r["reason"] else ""), file=out)
                print(f"      {r['target']}", file=out)
        print(file=out)
        n_ok = sum(r["status"] == "ok" for r in rows)
        n_opt = sum(r["status"] != "ok" and r["optional"] for r in rows)
        print(f"  {n_ok} ok, {len(failed)} skipped, {n_opt} optional absent (code this release does not have)",
              file=out)
        if failed:
            print("  Skipped hooks record nothing; the detectors that need their events cannot run.", file=out)
        doctor_coverage.print_text(cov, runner, out, ck)
        if for_cmd is not None:
            _print_command(for_cmd, cov, out)
    return 1 if failed else 0


def _print_command(res: dict[str, Any], cov: list[dict[str, Any]], out: Any) -> None:
    from pdtrace.commands.doctor_cmdline import verdicts, why_line

    print(file=out)
    print(f"  for: {' '.join(res['command'])[:200]}", file=out)
    if not res["ok"]:
        print(f"  model runner: unknown ({why_line(res)}); the estimate above stands", file=out)
        return
    r = res["runner"]
    print(f"  model runner: {r.upper()} ({why_line(res)})", file=out)
    v = verdicts(res, cov)
    w = max(map(len, v))
    for k, why in v.items():
        print(f"  {k:<{w}}  {why}", file=out)
