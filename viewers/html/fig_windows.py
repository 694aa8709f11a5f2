"""The drafter-window figure: per spec.window outside the allocation (or cited by a
finding), the token slots the request's blocks own vs the positions the drafter writes KV
to, red past the allocation."""

from __future__ import annotations

import html

from .common import GREEN, OWNED_SLOTS, RED, Model, layout, legend


def caption(fig: dict | None, note: str) -> str:
    items = legend([fig] if fig else [], [
        ("token slots owned", OWNED_SLOTS, "bars: the token slots the request's blocks own"),
        ("drafter write window", GREEN, "thin bars: drafter KV writes inside the allocation"),
        ("drafter write window", RED, "thin bars: drafter KV writes past the allocation"),
    ])
    return (items + ". " if items else "") + (html.escape(note) + "." if note else "")


def windows(m: Model, limit: int) -> tuple[dict | None, str]:
    """Drafter KV write windows vs the token slots the request's blocks cover."""
    bs_of: dict[str, list[int]] = {}
    for e in m.events:
        if e["ev"] == "sched.config":
            bs_of.setdefault(e.get("inst", "-"), list(e.get("block_sizes") or []))
    last_alloc: dict[tuple[str, str], dict] = {}
    local_blocks: dict[str, list] = {}
    rows = []
    win_ids = {i for f in m.findings if f.kind == "drafter-window-outside-allocation" for i in f.event_ids}
    win_reqs = {f.req for f in m.findings if f.kind == "drafter-window-outside-allocation"}
    n_windows = unjudged = 0
    reduced = m.totals is not None
    for e in m.events:
        k = e["ev"]
        if k == "sched.alloc" and "req" in e:
            last_alloc[(e.get("inst"), e["req"])] = e
        elif k == "nixl.remote_alloc" and "req" in e:
            local_blocks[e["req"]] = e.get("local_block_ids") or []
        elif k == "spec.window" and "req" in e:
            n_windows += 1
            g = e.get("group", 0) or 0
            a = last_alloc.get((e.get("inst"), e["req"]))
            cited = e.get("id") in win_ids or e["req"] in win_reqs
            if not cited and (reduced or (a is None and e["req"] not in local_blocks)):
                # Not judged here, as the detector judges none: a window with no allocation known (a model
                # runner's warm-up, `_warmup_0_` on vLLM 0.24.0's V2, has no scheduler allocation), and in a
                # trace read in two passes every window a finding does not cite (the other requests' windows
                # of a finding's step are kept, their allocations of earlier steps are not: held to the last
                # allocation kept, they looked outside it on a live 0.24.0 trace with no window finding)
                unjudged += not reduced
                continue
            blocks = (a or {}).get("block_ids") or local_blocks.get(e["req"]) or []
            bsz = bs_of.get(e.get("inst"), [])
            bs = bsz[g] if g < len(bsz) else None
            nb = len(blocks[g]) if g < len(blocks) else 0
            slots = nb * bs if bs else None
            outside = slots is not None and e["end"] > slots
            if outside or cited:
                rows.append((e, slots, outside, nb, bs))
    if m.totals is not None:  # a trace read in two passes: the windows of requests with findings were kept
        n_windows = m.totals.kinds.get("spec.window", 0)
    if not rows:
        held = (f" ({unjudged} with no allocation recorded, not judged: a model runner's warm-up has none)"
                if unjudged else "")
        return None, (f"{n_windows} drafter write window(s) in the trace{held}; none writes past the request's "
                      f"blocks" if n_windows else "")
    shown = rows[:limit]
    traces = []
    ya, xa, ba, ha = [], [], [], []
    yw, xw, bw, hw, cw = [], [], [], [], []
    for e, slots, outside, nb, bs in shown:
        label = f"{e['req']} s{e.get('step')} ({e.get('inst')})"
        if slots is not None:
            ya.append(label), ba.append(0), xa.append(slots)
            ha.append(f"{nb} block(s) × {bs} = {slots} token slots owned")
        yw.append(label), bw.append(e["start"]), xw.append(max(e["end"] - e["start"], 0.1))
        cw.append(RED if outside else GREEN)
        hw.append(f"<b>drafter ({html.escape(str(e.get('method')))}) writes KV</b> positions {e['start']}–{e['end'] - 1}"
                  f"<br>owned slots: {slots}" + ("<br><b>writes past the allocation</b>" if outside else ""))
    traces.append({"type": "bar", "orientation": "h", "base": ba, "x": xa, "y": ya, "name": "token slots owned",
                   "hovertext": ha, "hoverinfo": "text", "marker": {"color": OWNED_SLOTS}, "width": 0.8})
    traces.append({"type": "bar", "orientation": "h", "base": bw, "x": xw, "y": yw, "name": "drafter write window",
                   "hovertext": hw, "hoverinfo": "text", "marker": {"color": cw}, "width": 0.4})
    lay = layout("Drafter KV write windows vs owned token slots", barmode="overlay",
                     height=max(260, 40 * len(shown) + 140),
                     xaxis={"title": {"text": "token position"}}, yaxis={"type": "category", "automargin": True})
    note = f"{len(rows)} window(s) outside the allocation or cited by a finding"
    if len(rows) > limit:
        note += f"; first {limit} drawn"
    return {"data": traces, "layout": lay}, note
