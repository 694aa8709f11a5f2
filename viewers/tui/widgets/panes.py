"""The Block map, Connector metadata and Raw events panes.

Each pane renders a model object from ``viewers.tui.model`` as Rich text for its current
width (``base.Pane``); the app decides what is selected and calls ``show``. The Accepted
counts and Drafter window panes live in ``accepted.py`` and ``window.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from rich.text import Text

from pdtrace.detectors.kv_load import describe

from .. import drafter, model
from .base import BAD, OK, Pane, finding_footer, para
from .window import draw_window

CELL = 24


def _cell(c: model.Cell | None) -> Text:
    if c is None:
        return Text(" " * CELL)
    t = Text()
    t.append(f"[{c.block:>5}]", style="bold")
    if c.failed:
        t.append(" ✗ LOAD FAILED" + (f" s{c.failed_step}" if c.failed_step is not None else ""), style="bold red")
    elif c.state:
        t.append(" state      ", style="magenta")
    elif c.lookahead:
        t.append(" LA lookahead", style="yellow")
    elif c.tokens is not None:
        t.append(f" tok {c.tokens[0]}-{c.tokens[1]}".ljust(13))
    else:
        t.append(" ?".ljust(13), style="dim")
    t.pad_right(CELL - len(t.plain))
    return t


class BlockMapPane(Pane):
    """P's reported blocks next to D's, the local <- remote pairs (verdict first on each
    pair line, the reason wrapped under it when it does not fit), and the drafter's write
    windows of the pair when one reaches past its allocation."""

    def build(self, width: int, bm: model.BlockMap | None, req: str | None, findings: list[Any],
              selected: Any = None, windows: list[drafter.Window] | None = None, elsewhere: str = "") -> Text:
        t = Text()
        windows = windows or []
        if bm is None and not windows:
            t.append(f"No NIXL block events for request {req}.\n" if req else
                     "Select a request (left; s shows the list) or a finding (f) to see its P and D blocks.\n", style="dim")
            if elsewhere:  # the request's findings are of another class: say where they show (a new user's pass)
                t.append(f"Its findings are in {elsewhere}: f opens the first there.\n", style="bold")
            return t
        self.head(t, findings, width, selected)
        outside = [w for w in windows if w.outside]
        if outside:
            t.append(" DRAFTER WRITES PAST THE ALLOCATION ", style=BAD)
            t.append(f"  {len(outside)} window(s); drawn below and in tab 4\n", style="bold red")
        if bm is not None and bm.loads:
            self._loads(t, width, bm)
        if bm is not None:
            self._pairs(t, width, bm)
        for w in outside[:3]:
            t.append("\n")
            draw_window(t, w, width)
        finding_footer(t, findings, width, selected)
        return t

    @staticmethod
    def _loads(t: Text, width: int, bm: model.BlockMap) -> None:
        """What the scheduler did with each failed load of the request, as `pdtrace check` says
        it (the blocks are marked ✗ LOAD FAILED in D's column below)."""
        t.append(" KV LOAD FAILED ", style=BAD)
        t.append(f"  {len(bm.loads)} failed load(s)\n", style="bold red")
        for n in bm.loads:
            para(t, describe(n), width, "red", indent=4, first="  ")

    @staticmethod
    def _pairs(t: Text, width: int, bm: model.BlockMap) -> None:  # noqa: C901
        t.append("Request ", style="bold")
        p, d = f"P:{bm.p_req or '-'}", f"D:{bm.d_req or '-'}"
        if len(p) + len(d) + 14 <= width:
            t.append(f"{p}  ->  {d}\n", style="bold cyan")
        else:  # long ids (vLLM's cmpl-<hex>-0-<hex>): one per line, cut in the middle with an ellipsis
            t.append(_middle(p, width - 9) + "\n", style="bold cyan")
            t.append("    ->  " + _middle(d, width - 9) + "\n", style="bold cyan")
        para(t, f"remote_num_tokens={bm.remote_num_tokens}  prompt_len={bm.prompt_len}  "
                f"pairs from {bm.source or ('(none: the load failed before a read)' if bm.loads else '(no trim or read recorded)')}",
             width, "dim")
        if bm.mismatches:
            t.append(f" {bm.mismatches} MISMATCHED local<-remote pair(s) ", style=BAD)
            t.append("\n")
        elif any(g.pairs for g in bm.groups):
            t.append("all local<-remote pairs hold the same tokens\n", style=OK)
        n, bad = bm.bytes_compared
        if bad:
            t.append(f" bytes of {bad} of {n} compared block(s) DIFFER from P's (record --kv-checksum) ", style=BAD)
            t.append("\n")
        elif n:
            t.append(f"bytes of all {n} compared block(s) equal P's (record --kv-checksum)\n", style=OK)
        for g in bm.groups:
            whole = bool(g.load) and not (g.load["not_loaded"] or g.load["not_transferred"])
            t.append(f"\nGroup {g.group}  {g.kind}  block size {g.block_size}"
                     + ("  (the drafter's)" if g.load and g.load.get("draft") else "")
                     + (f"  {g.load['loaded']} tok {'to load (failed)' if g.load.get('failed') else 'loaded'}"
                        if whole else "") + "\n", style="bold underline")
            if g.load and not whole:  # (a group that got every loaded token: the heading says so)
                _load_line(t, width, g.load)
            if g.pairs:
                t.append("  pairs  local <- remote\n", style="dim")
            for p in g.pairs:
                if p.local.block < 0:
                    para(t, f"✗ {p.why}", width, BAD, indent=4, first="  ")
                    continue
                head = f"  D {p.local.block:>5} <- P {p.remote.block:<5}"
                if p.ok and p.bytes != "differ":
                    t.append(head + "  ok" + ("  bytes =" if p.bytes == "same" else "")
                             + (f"  {p.why}" if p.why else "") + "\n", style=OK)
                    continue
                if p.ok:  # the right block, other bytes
                    t.append(head, style=BAD)
                    t.append("  ✗ bytes differ from P's\n", style="bold red")
                    continue
                t.append(head, style=BAD)
                if p.bytes == "differ":
                    p = dataclasses.replace(p, why=p.why + "; bytes differ")
                if len(head) + 4 + len(p.why) <= width:
                    t.append(f"  ✗ {p.why}\n", style="bold red")
                else:
                    t.append("  ✗ MISMATCH\n", style="bold red")
                    para(t, p.why, width, "bold red", indent=6, first="      ")
            t.append("  P blocks (reported)".ljust(CELL + 4) + "D blocks (local)\n", style="dim")
            dpos = {c.pos: c for c in g.d_blocks}
            ppos = {(c.pos if c.pos is not None else k): c for k, c in enumerate(g.p_blocks)}
            rows = max([p + 1 for p in (*ppos, *dpos) if p is not None] + [0])
            skipped = 0
            for k in range(rows):
                if k not in ppos and k not in dpos:  # (a sliding window's positions before its tail: no block)
                    skipped += 1
                    continue
                if skipped:
                    t.append(f"  (block position(s) {k - skipped}-{k - 1}: no block on either side)\n", style="dim")
                    skipped = 0
                t.append("  ")
                t.append_text(_cell(ppos.get(k)))
                t.append("  ")
                t.append_text(_cell(dpos.get(k)))
                t.append("\n")
        t.append(f"\nblock-map events: {', '.join(map(str, bm.event_ids))}\n", style="dim")


def _load_line(t: Text, width: int, ld: dict) -> None:
    """What of D's load reached a group (kv-never-crossed's per-group facts): red where D's scheduler counts
    tokens computed that nothing wrote into the group."""
    lo, hi = ld["range"]
    span = f"positions {lo}-{hi - 1}"
    if ld["not_transferred"]:
        t.append("  ")
        t.append(" NOT A TRANSFER GROUP ", style=BAD)
        t.append("\n")
        para(t, f"none of the {hi - lo} loaded token(s) ({span}) reached it: D's scheduler counts them as done, "
                f"no load and no forward on D wrote them" + (" (the drafter's group: vLLM #54926's shape)"
                                                             if ld.get("draft") else ""), width, "bold red", indent=4)
        return
    words = (f"{'to load from P (the load failed)' if ld.get('failed') else 'loaded from P'}: {ld['loaded']} of the "
             f"{hi - lo} token(s) ({span})")
    if ld["blocks"]:
        words += f", {ld['blocks']} block(s)"
    if ld["not_loaded"]:
        words += (f"; the first {ld['not_loaded']} not loaded" + (" (outside the window: never read again)"
                                                                 if ld.get("tail") else ""))
    para(t, words, width, "dim", indent=4, first="  ")


class MetadataPane(Pane):
    def build(self, width: int, views: list[model.MetaView], step: int | None, findings: list[Any],
              selected: Any = None) -> Text:
        t = Text()
        self.head(t, findings, width, selected)
        if not views:
            t.append(f"No connector-metadata events at step {step}.\n", style="dim")
            return t
        for v in views:
            t.append(f"Instance {v.inst}  step {v.step}", style="bold underline")
            if v.gaps:
                t.append(f"  {v.gaps} gap(s)", style=BAD)
            t.append("\n")
            for line in v.lines:
                ind = 2 * (line.depth + 1)
                text = ("✗ " if line.bad else "") + line.text + f"  #{line.event_id}"
                para(t, text, width, BAD if line.bad else "", indent=ind + 2, first=" " * ind)
            t.append("\n")
        finding_footer(t, findings, width, selected)
        return t


class RawPane(Pane):
    def show(self, *args: Any) -> None:
        super().show(*args)
        if len(args) > 3 and args[3] is not None:
            self.scroll_home(animate=False)  # a search match is drawn first: bring it into view

    def build(self, width: int, events: list[dict[str, Any]], what: str, marked: set[int],
              found: int | None = None) -> Text:
        t = Text()
        para(t, f"{what}  ({len(events)} events)", width, "bold")
        for e in events:
            body = orjson.dumps(e, option=orjson.OPT_INDENT_2).decode()
            if found is not None and e.get("id") == found:
                t.append(f"#{e.get('id')} {e['ev']}  <- search match\n", style="bold black on yellow")
                t.append(body + "\n", style="bold")
            elif e.get("id") in marked:
                t.append(f"#{e.get('id')} {e['ev']}  <- cited by the finding\n", style=BAD)
                t.append(body + "\n", style="red")
            else:
                t.append(f"#{e.get('id')} {e['ev']}\n", style="bold cyan")
                t.append(body + "\n")
        return t


def _middle(s: str, n: int) -> str:
    """``s`` in at most ``n`` characters, its middle replaced by an ellipsis when longer."""
    if len(s) <= n or n < 5:
        return s
    keep = n - 1
    return s[: keep - keep // 2] + "…" + s[len(s) - keep // 2:]
