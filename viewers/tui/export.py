"""Export from the viewer: the selected finding as Markdown (clipboard and a file) and the
screen as SVG. ``finding_markdown`` is plain Python; ``ExportMixin`` holds the app actions."""

from __future__ import annotations

import os
import re
from typing import Any

import orjson


def finding_markdown(f: Any, trace: str = "") -> str:
    """A finding as a Markdown block to paste into an issue."""
    where = [f"`{x}`" if x else "-" for x in (f.req, f.inst)]
    lines = [
        f"### {f.kind} ({getattr(f, 'severity', 'error')})",
        "",
        f"**{f.title}**",
        "",
    ]
    if trace:
        lines.append(f"- trace: `{trace}`")
    lines += [
        f"- request: {where[0]}, step: {f.step if f.step is not None else '-'}, instance: {where[1]}",
        f"- events: {', '.join(map(str, f.event_ids or [])) or '-'}",
        "",
        f.explanation,
        "",
    ]
    if f.data:
        body = orjson.dumps(f.data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS, default=str).decode()
        lines += ["<details><summary>data</summary>", "", "```json", body, "```", "", "</details>", ""]
    return "\n".join(lines)


def finding_filename(f: Any) -> str:
    parts = [f.kind, f.req or "", f"s{f.step}" if f.step is not None else ""]
    stem = "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", p) for p in parts if p)
    return f"pdtrace-finding-{stem}.md"


class ExportMixin:
    """``c``: copy the selected finding; ``S``: save the screen as SVG. Files go to
    ``self.export_dir`` (the working directory unless the app was given another)."""

    export_dir: str
    finding: Any
    findings: list[Any]

    def action_copy_finding(self) -> None:
        f = self.finding if self.finding is not None else (self.findings[0] if self.findings else None)
        if f is None:
            self.notify("no finding to copy", severity="warning")  # type: ignore[attr-defined]
            return
        name = getattr(self.index, "source", None) or self.index.path  # type: ignore[attr-defined]
        trace = os.path.basename(name.rstrip("/")) if name else ""
        md = finding_markdown(f, trace)
        self.copy_to_clipboard(md)  # type: ignore[attr-defined]
        path = os.path.join(self.export_dir, finding_filename(f))
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(md)
        except OSError as exc:
            self.notify(f"copied to the clipboard; could not write {path}: {exc}", severity="error")  # type: ignore[attr-defined]
            return
        self.last_export = path
        self.notify(f"finding copied to the clipboard (OSC 52) and written to {path}")  # type: ignore[attr-defined]

    def action_save_svg(self) -> None:
        try:
            path = self.save_screenshot(path=self.export_dir)  # type: ignore[attr-defined]
        except OSError as exc:
            self.notify(f"could not save the screen: {exc}", severity="error")  # type: ignore[attr-defined]
            return
        self.last_export = path
        self.notify(f"screen saved as {path}")  # type: ignore[attr-defined]
