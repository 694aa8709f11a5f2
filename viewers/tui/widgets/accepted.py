"""The Accepted counts pane: one row per CPU read of num_accepted_tokens.

Columns come in the order a reader needs them: row, request, verdict; then the detail
columns (value, truth, owners, copy/read times) as many as the width holds. Details that
do not fit go into a dim line under the row, and each red reason (STALE / WRONG ROW /
WRONG VALUE) gets a line of its own, wrapped, so nothing is cut at 80 columns.
"""

from __future__ import annotations

from typing import Any, Callable

from rich.text import Text

from .. import model
from .base import BAD, OK, Pane, finding_footer, para

TAGS = {"stale": "STALE", "wrong-row": "WRONG ROW", "wrong-value": "WRONG VALUE", "inconclusive": "INCONCLUSIVE"}


def _ns(t: int | None, base: int | None) -> str:
    if t is None:
        return "-"
    if base is None:
        return str(t)
    return f"{(t - base) / 1e6:+.3f}ms"


def _owner(x: str | None) -> str:
    return "-" if x is None else (x or "(empty)")


# (header, width, value) of the detail columns, in the order they are dropped last-first
DETAILS: list[tuple[str, int, Callable[[model.AccRow], str]]] = [
    ("value", 5, lambda r: str(r.value)),
    ("truth", 5, lambda r: "-" if r.truth is None else str(r.truth)),
    ("owner@issue", 11, lambda r: _owner(r.owner_at_issue)),
    ("owner now", 10, lambda r: _owner(r.owner_now)),
    ("D2H issued", 11, lambda r: _ns(r.issue_t, r.read_t)),
    ("completed", 11, lambda r: _ns(r.done_t, r.read_t)),
]


def verdict(r: model.AccRow) -> str:
    return "ok" if r.status == "ok" else " ".join(TAGS.get(s, s.upper()) for s in r.status.split(","))


def reasons(r: model.AccRow) -> list[str]:
    tags = r.status.split(",")
    out = []
    if "stale" in tags:
        out.append(f"STALE: read before the copy's event completed (event_done={r.event_done}, synced={r.synced})")
    f = r.finding
    if "wrong-row" in tags:
        held = (f.data.get("held") or []) if f is not None else []
        if len(held) > 1 and held[1] != r.req:  # the detector's replay: whose count the row held when read
            whose = f"{held[1]}'s 1 from add_request" if held[0] == "a" else f"{held[1]}'s count"
            out.append(f"WRONG ROW: row {r.row} held {whose} when read, not {r.req}'s"
                       + (f" (moved there by trace event {f.data['moved_by']})" if f.data.get("moved_by") else ""))
        else:  # a read that raced its copy: the copy lands the count of the row's owner at copy time
            out.append(f"WRONG ROW: row {r.row} held {r.owner_at_issue or r.owner_now} at copy time, not {r.req}")
    if "inconclusive" in tags:
        out.append("INCONCLUSIVE: the trace does not say whether the copy landed before or after a row move "
                   "that decides this read")
    if "wrong-value" in tags:
        own = f.data.get("own") if f is not None else None
        out.append(f"WRONG VALUE: read {r.value}, " + (f"the copy's own count {own}" if own is not None
                                                       else f"authoritative value {r.truth}"))
    return out


class AcceptedPane(Pane):
    def build(self, width: int, views: list[model.AccView], step: int | None, findings: list[Any],
              selected: Any = None) -> Text:
        t = Text()
        self.head(t, findings, width, selected)
        if not views:
            t.append(f"No accepted-count reads at step {step}.\n", style="dim")
            return t
        for v in views:
            bad = sum(r.bad for r in v.rows)
            t.append(f"Instance {v.inst}  step {v.step}", style="bold underline")
            t.append(f"  {bad} bad read(s), listed first\n" if bad else "  all reads ok\n",
                     style="bold red" if bad else OK)
            reqw = max([8] + [len(r.req) for r in v.rows])
            verw = max([7] + [len(verdict(r)) for r in v.rows])
            used = 3 + 2 + reqw + 1 + verw
            cols = []
            for col in DETAILS:
                w = max(col[1], max(len(col[2](r)) for r in v.rows))
                if used + 1 + w > width:
                    break
                cols.append((col[0], w, col[2]))
                used += 1 + w
            hidden = DETAILS[len(cols):]
            hdr = f"{'row':>3}  {'read for':<{reqw}} {'verdict':<{verw}}" + "".join(f" {h:>{w}}" for h, w, _ in cols)
            t.append(hdr + "\n", style="dim")
            for r in sorted(v.rows, key=lambda r: not r.bad):  # the bad reads on screen first (stable: by row)
                t.append(f"{r.row:>3}  {r.req:<{reqw}} ", style="bold" if r.bad else "")
                t.append(f"{verdict(r):<{verw}}", style=BAD if r.bad else OK)
                t.append("".join(f" {fn(r):>{w}}" for _, w, fn in cols) + "\n")
                for why in reasons(r):
                    para(t, "✗ " + why, width, "bold red", indent=7, first="     ")
                extra = [f"{h}={fn(r)}" for h, _, fn in hidden]
                if r.event_done is not None and not r.bad:
                    extra.append(f"event_done={r.event_done}")
                if r.synced is not None and not r.bad:
                    extra.append(f"synced={r.synced}")
                if extra:
                    para(t, "  ".join(extra), width, "dim", indent=7, first="     ")
                if r.history:
                    hist = " -> ".join(f"s{s}:{o or '(empty)'}" for s, o in r.history)
                    para(t, f"row {r.row} owners: {hist}", width, "dim", indent=7, first="     ")
            own = ", ".join(f"{row}:{req or '(empty)'}" for row, req in sorted(v.owners.items()))
            para(t, f"rows at end of step: {own}", width, "dim", indent=4, first="  ")
            t.append("\n")
        finding_footer(t, findings, width, selected)
        return t
