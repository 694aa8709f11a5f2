"""The four selection panes: Block map, Accepted counts, Connector metadata, Raw events.

Each pane renders a model object from ``viewers.tui.model`` as Rich text; the app
decides what is selected and calls ``show``.
"""

from __future__ import annotations

from typing import Any, Iterable

import orjson
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from .. import model

BAD = "bold white on red"
OK = "green"


class Pane(VerticalScroll):
    DEFAULT_CSS = """
    Pane { height: 1fr; padding: 0 1; }
    Pane > Static { width: auto; }
    """

    def compose(self):
        yield Static(id=f"{self.id}-body", classes="pane-body")

    _shown: Text | None = None

    def set_text(self, text: Text) -> None:
        self._shown = text
        self.query_one(Static).update(text)

    @property
    def text(self) -> str:
        """Plain text of what is shown (tests)."""
        return self._shown.plain if self._shown is not None else ""

    @property
    def shown(self) -> Text | None:
        return self._shown


def _finding_header(t: Text, findings: Iterable[Any]) -> None:
    for f in findings:
        t.append(f" {f.kind} ", style=BAD)
        t.append(f" {f.title}\n", style="bold red")
        t.append(f"{f.explanation}\n\n", style="italic")


def _cell(c: model.Cell | None) -> Text:
    if c is None:
        return Text(" " * 24)
    t = Text()
    t.append(f"[{c.block:>5}]", style="bold")
    if c.state:
        t.append(" state      ", style="magenta")
    elif c.lookahead:
        t.append(" LA lookahead", style="yellow")
    elif c.tokens is not None:
        t.append(f" tok {c.tokens[0]}-{c.tokens[1]}".ljust(13))
    else:
        t.append(" ?".ljust(13), style="dim")
    t.pad_right(24 - len(t.plain))
    return t


class BlockMapPane(Pane):
    def show(self, bm: model.BlockMap | None, req: str | None, findings: list[Any]) -> None:
        t = Text()
        if bm is None:
            t.append(f"No NIXL block events for request {req}.\n" if req else
                     "Select a request (left) or a finding to see its P and D blocks.\n", style="dim")
            self.set_text(t)
            return
        _finding_header(t, findings)
        t.append("Request ", style="bold")
        t.append(f"P:{bm.p_req or '-'}  ->  D:{bm.d_req or '-'}", style="bold cyan")
        t.append(f"   remote_num_tokens={bm.remote_num_tokens}  prompt_len={bm.prompt_len}"
                 f"   pairs from {bm.source or '(no trim/read yet)'}\n")
        if bm.mismatches:
            t.append(f" {bm.mismatches} MISMATCHED local<-remote pair(s) ", style=BAD)
            t.append("\n")
        for g in bm.groups:
            t.append(f"\nGroup {g.group}  {g.kind}  block size {g.block_size}\n", style="bold underline")
            t.append("  P blocks (reported)".ljust(28) + "D blocks (local)\n", style="dim")
            dpos = {c.pos: c for c in g.d_blocks}
            rows = max([len(g.p_blocks)] + [p + 1 for p in dpos if p is not None] + [0])
            for k in range(rows):
                t.append("  ")
                t.append_text(_cell(g.p_blocks[k] if k < len(g.p_blocks) else None))
                t.append("  ")
                t.append_text(_cell(dpos.get(k)))
                t.append("\n")
            if g.pairs:
                t.append("  pairs  local <- remote\n", style="dim")
            for p in g.pairs:
                if p.local.block < 0:
                    t.append(f"  ✗ {p.why}\n", style=BAD)
                    continue
                line = f"  D {p.local.block:>5} <- P {p.remote.block:<5}"
                if p.ok:
                    t.append(line + "  ok\n", style=OK)
                else:
                    t.append(line, style=BAD)
                    t.append(f"  ✗ {p.why}\n", style="bold red")
        t.append(f"\nevents: {', '.join(map(str, bm.event_ids))}\n", style="dim")
        self.set_text(t)


def _ns(t: int | None, base: int | None) -> str:
    if t is None:
        return "-"
    if base is None:
        return str(t)
    return f"{(t - base) / 1e6:+.3f}ms"


class AcceptedPane(Pane):
    def show(self, views: list[model.AccView], step: int | None, findings: list[Any]) -> None:
        t = Text()
        _finding_header(t, findings)
        if not views:
            t.append(f"No accepted-count reads at step {step}.\n", style="dim")
            self.set_text(t)
            return
        for v in views:
            t.append(f"Instance {v.inst}  step {v.step}\n", style="bold underline")
            hdr = f"{'row':>3}  {'read for':<10} {'value':>5} {'truth':>5}  {'owner@issue':<11} {'owner now':<10} " \
                  f"{'D2H issued':>11} {'completed':>11} {'read at':>11}  status"
            t.append(hdr + "\n", style="dim")
            for r in v.rows:
                base = r.read_t
                line = (f"{r.row:>3}  {r.req:<10} {r.value:>5} {('-' if r.truth is None else r.truth):>5}  "
                        f"{(r.owner_at_issue if r.owner_at_issue is not None else '-') or '(empty)':<11} "
                        f"{(r.owner_now or '(empty)'):<10} {_ns(r.issue_t, base):>11} {_ns(r.done_t, base):>11} "
                        f"{'0':>11}  ")
                t.append(line, style="bold" if r.bad else "")
                tags = r.status.split(",")
                if "stale" in tags:
                    t.append(" STALE: read before the copy's event completed ", style=BAD)
                    t.append(" ")
                if "wrong-row" in tags:
                    t.append(f" WRONG ROW: row {r.row} held {r.owner_at_issue or r.owner_now!s} at copy time ", style=BAD)
                    t.append(" ")
                if "wrong-value" in tags:
                    t.append(f" WRONG VALUE: {r.value} != {r.truth} ", style=BAD)
                if r.status == "ok":
                    t.append("ok", style=OK)
                extra = []
                if r.event_done is not None:
                    extra.append(f"event_done={r.event_done}")
                if r.synced is not None:
                    extra.append(f"synced={r.synced}")
                t.append(f"  {' '.join(extra)}\n", style="dim")
                if r.history:
                    hist = "  ->  ".join(f"s{s}:{o or '(empty)'}" for s, o in r.history)
                    t.append(f"      row {r.row} owners: {hist}\n", style="dim")
            own = ", ".join(f"{row}:{req or '(empty)'}" for row, req in sorted(v.owners.items()))
            t.append(f"  rows at end of step: {own}\n\n", style="dim")
        self.set_text(t)


class MetadataPane(Pane):
    def show(self, views: list[model.MetaView], step: int | None, findings: list[Any]) -> None:
        t = Text()
        _finding_header(t, findings)
        if not views:
            t.append(f"No connector-metadata events at step {step}.\n", style="dim")
            self.set_text(t)
            return
        for v in views:
            t.append(f"Instance {v.inst}  step {v.step}", style="bold underline")
            if v.gaps:
                t.append(f"  {v.gaps} gap(s)", style=BAD)
            t.append("\n")
            for line in v.lines:
                t.append("  " * (line.depth + 1))
                t.append(("✗ " if line.bad else "") + line.text, style=BAD if line.bad else "")
                t.append(f"  #{line.event_id}\n", style="dim")
            t.append("\n")
        self.set_text(t)


class RawPane(Pane):
    def show(self, events: list[dict[str, Any]], what: str, marked: set[int]) -> None:
        t = Text()
        t.append(f"{what}  ({len(events)} events)\n", style="bold")
        for e in events:
            body = orjson.dumps(e, option=orjson.OPT_INDENT_2).decode()
            if e.get("id") in marked:
                t.append(f"#{e.get('id')} {e['ev']}  <- cited by the finding\n", style=BAD)
                t.append(body + "\n", style="red")
            else:
                t.append(f"#{e.get('id')} {e['ev']}\n", style="bold cyan")
                t.append(body + "\n")
        self.set_text(t)
