"""The Drafter window pane: where the drafter writes KV, over the blocks the request owns.

One picture per ``spec.window`` (``viewers.tui.drafter``): a strip of the window's
positions (green inside the allocation, red past it, ``│`` at block boundaries) and one
line per block index the window touches -- the block owned there, or, past the
allocation, the block-table entry the write would hit and the requests (prefix cache)
holding that block.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from .. import drafter
from .base import BAD, OK, Pane, finding_footer, para

MAX_STRIP = 64


def _span(ps: list[int]) -> str:
    if not ps:
        return "-"
    return str(ps[0]) if len(ps) == 1 else f"{ps[0]}-{ps[-1]}"


def _owner_text(b: drafter.WindowBlock) -> str:
    if b.stale_block is None:
        return "no block owned here: the block-table entry is stale or padding"
    who = (f"held by {', '.join(b.held_by)}" + (" (shared prefix-cache block)" if b.shared else "")
           if b.held_by else "not held by any live request")
    left = f" (left in the row by {b.stale_from})" if b.stale_from else ""
    return f"writes block {b.stale_block}{left}, {who}"


def draw_window(t: Text, w: drafter.Window, width: int) -> None:
    bad = bool(w.outside)
    t.append(f"step {w.step}  {w.inst}  {w.req}  {w.method} drafter  window [{w.start}, {w.end})",
             style="bold red" if bad else "bold")
    t.append(f"  group {w.group}  block size {w.block_size}\n", style="dim")
    owned = ", ".join(map(str, w.owned[:8])) + (", ..." if len(w.owned) > 8 else "")
    if w.alloc_id is None:
        para(t, "allocation: none recorded for this request on this instance (a model runner's warm-up "
                "request has none): the window is not judged", width, "dim", indent=4, first="  ")
        return  # no strip, no block table: nothing to hold the positions to
    para(t, f"allocation (sched.alloc #{w.alloc_id}): {len(w.owned)} block(s) [{owned}] = positions "
            f"0..{w.capacity - 1}; lookahead asked: {w.lookahead}", width, "dim", indent=4, first="  ")
    if bad:
        para(t, f"✗ {len(w.outside)} write position(s) {_span(w.outside)} past the allocation "
                f"(slot {w.capacity} and on)", width, BAD, indent=4, first="  ")
    # the strip: the last positions of the window that fit
    pos = list(range(w.start, w.end))
    cw = len(str(max(pos[-1], 0))) + 1 if pos else 2
    fit = max(4, min(MAX_STRIP, (width - 14) // cw))
    cut = pos[-fit:]
    nums, bars = Text("  positions  "), Text("  drafter    ")
    if len(cut) < len(pos):
        nums.append("… ", style="dim")
        bars.append("  ")
    for p in cut:
        sep = "│" if p % w.block_size == 0 and p != cut[0] else " "
        nums.append(sep, style="dim")
        bars.append(sep, style="dim")
        nums.append(str(p).rjust(cw - 1), style="bold red" if p >= w.capacity else "")
        bars.append("█" * (cw - 1), style="red" if p >= w.capacity else OK)
    t.append_text(nums)
    t.append("\n")
    t.append_text(bars)
    t.append("\n")
    t.append("  block#  block       covers      writes\n", style="dim")
    for b in w.blocks:
        blk = f"[{b.block:>5}]" if b.owned else "not owned"
        line = f"  {b.index:>6}  {blk:<10}  {b.lo}-{b.hi:<8}  {_span(b.writes):<9}"
        if b.owned:
            t.append(line + ("  ok\n" if b.writes else "\n"), style=OK if b.writes else "")
            continue
        t.append(line, style=BAD)
        t.append("\n")
        para(t, ("✗ OUTSIDE: " + _owner_text(b)) if b.writes else "not owned", width, "bold red",
             indent=6, first="    ")


class WindowPane(Pane):
    def build(self, width: int, ws: list[drafter.Window], req: str | None, step: int | None,
              findings: list[Any], selected: Any = None) -> Text:
        t = Text()
        self.head(t, findings, width, selected)
        if not req:
            t.append("Select a request (left; s shows the list) or a finding (f) to see its drafter write windows.\n", style="dim")
            return t
        if not ws:
            para(t, f"No drafter write windows (spec.window) for request {req}: the drafter method "
                    "has no KV cache of its own, or the trace has no such events.", width, "dim")
            return t
        shown, rest = drafter.pick(ws, step)
        n_out = sum(bool(w.outside) for w in ws)
        reqs = " and ".join(dict.fromkeys(w.req for w in ws))
        para(t, f"{len(ws)} drafter window(s) of {reqs}:", width, "bold")
        if n_out:
            t.append(f" {n_out} OUTSIDE THE ALLOCATION ", style=BAD)
            t.append("\n")
        elif all(w.alloc_id is None for w in ws):
            t.append("no allocation recorded: not judged\n", style="dim")
        else:
            t.append("all inside the allocation\n", style=OK)
        for w in shown:
            t.append("\n")
            draw_window(t, w, width)
        if rest:
            t.append(f"\n{rest} other window(s) inside their allocation not drawn\n", style="dim")
        finding_footer(t, findings, width, selected)
        return t
