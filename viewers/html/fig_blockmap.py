"""Block-mapping figures, one per affected request: x is the request's logical block index
(tick label: D's local block id), y the remote (P) block id. Expected P blocks (those
covering the computed tokens), the lookahead blocks P reported beyond them, and the pairing
D actually used, red where it differs from the expected block."""

from __future__ import annotations

from .common import GREEN, ORANGE, RED, Model, ceil_div, esc, layout, legend


def caption(figs: list[dict], note: str) -> str:
    items = legend(figs, [
        ("expected P block", GREEN, "rings: the P block expected at that position (blocks covering the computed "
         "tokens)"),
        ("P lookahead block", ORANGE, "squares: lookahead blocks P reported beyond them"),
        ("actual pairing", GREEN, "●: D paired the expected P block"),
        ("actual pairing", RED, "×: D paired another P block (mismatch), or its bytes differ from P's block at that "
         "position (record --kv-checksum; the point's text says which)"),
        ("shift", RED, "dotted line: from the expected to the paired P block"),
    ])
    return ("x: logical block index of the request (tick label: D local block id); y: P block id. "
            + (items + ". " if items else "") + f"{esc(note)}.")


def block_maps(m: Model, limit: int) -> tuple[list[tuple[str, str, dict]], str]:
    """One figure per affected request: logical block index vs remote (P) block id."""
    bs_of: dict[str, list[int]] = {}
    for e in m.events:
        if e["ev"] == "sched.config":
            bs_of.setdefault(e.get("inst", "-"), list(e.get("block_sizes") or []))
    p_fin = {e["req"]: e for e in m.events if e["ev"] == "nixl.request_finished" and e.get("side") == "P" and "req" in e}
    pairing: dict[str, dict] = {}
    remote_alloc: dict[str, dict] = {}
    for e in m.events:
        if e["ev"] == "nixl.trim" and "req" in e:
            pairing[e["req"]] = e
        elif e["ev"] == "nixl.read" and "req" in e and e["req"] not in pairing:
            pairing[e["req"]] = e
        elif e["ev"] == "nixl.remote_alloc" and "req" in e:
            remote_alloc[e["req"]] = e

    digests: dict[tuple, dict] = {}  # (side, request, group) -> {block: digest}: record --kv-checksum
    for e in m.events:
        if e["ev"] == "kv.digest" and "req" in e:
            for g, d in (e.get("blocks") or {}).items():
                digests[(e.get("side"), e["req"], str(g))] = d or {}
    block_reqs = {f.req for f in m.findings if f.kind == "lookahead-block-misalignment" and f.req}
    block_reqs |= {f.req for f in m.findings if f.kind == "kv-invariant" and (f.data or {}).get("digest") and f.req}
    block_reqs |= {m.d2p[r] for r in block_reqs if r in m.d2p} | {m.p2d[r] for r in block_reqs if r in m.p2d}
    out: list[tuple[str, str, dict]] = []
    affected_total = 0
    ok_reqs: list[str] = []
    for dreq, pe in pairing.items():
        preq = m.d2p.get(dreq, dreq)
        fin = p_fin.get(preq)
        ra = remote_alloc.get(dreq)
        if pe["ev"] == "nixl.trim":
            local_in, remote_in = pe.get("local_in") or [], pe.get("remote_in") or []
            local_out, remote_out = pe.get("local_out") or [], pe.get("remote_out") or []
        else:
            local_out, remote_out = pe.get("local_block_ids") or [], pe.get("remote_block_ids") or []
            local_in = (ra or {}).get("local_block_ids") or local_out
            remote_in = (ra or {}).get("remote_block_ids") or remote_out
        reported = (fin or {}).get("block_ids") or remote_in
        ntok = (fin or {}).get("remote_num_tokens")
        if ntok is None:
            ntok = (ra or {}).get("remote_num_tokens")
        p_inst = (fin or {}).get("inst", "P")
        bsizes = bs_of.get(p_inst) or bs_of.get(pe.get("inst", "D")) or []
        traces: list[dict] = []
        mismatched = 0
        lookahead = 0
        differ = compared = 0
        tickvals: dict[int, str] = {}
        for g in range(max(len(local_out), len(reported))):
            rep = list(reported[g]) if g < len(reported) else []
            bs = bsizes[g] if g < len(bsizes) else None
            n_need = ceil_div(ntok, bs) if (ntok is not None and bs) else len(rep)
            expected = rep[:n_need]
            li = list(local_in[g]) if g < len(local_in) else []
            lo = list(local_out[g]) if g < len(local_out) else []
            ro = list(remote_out[g]) if g < len(remote_out) else []
            # D keeps a local prefix-cache hit at the front: local_in is D's whole list for the request;
            # its logical index i pairs with P's logical block i (the first computed-token blocks).
            off = max(len(expected) - len(li), 0) if li else 0
            ex_x = list(range(len(expected)))
            gtag = f" g{g}" if len(reported) > 1 else ""
            traces.append({"type": "scatter", "mode": "markers", "name": f"expected P block{gtag} (covers computed tokens)",
                           "x": ex_x, "y": expected, "hoverinfo": "text",
                           "hovertext": [f"logical block {i}: P block {b} holds tokens {i * bs if bs else '?'}–"
                                         f"{(i + 1) * bs - 1 if bs else '?'}" for i, b in zip(ex_x, expected)],
                           "marker": {"size": 18, "symbol": "circle-open", "color": GREEN, "line": {"width": 2}}})
            la = rep[n_need:]
            if la:
                lookahead += len(la)
                traces.append({"type": "scatter", "mode": "markers+text", "name": f"P lookahead block{gtag} (beyond computed tokens)",
                               "x": list(range(n_need, n_need + len(la))), "y": la, "text": ["lookahead"] * len(la),
                               "textposition": "top center", "hoverinfo": "text",
                               "hovertext": [f"P reported block {b} at logical index {n_need + k}, beyond the "
                                             f"{ntok} computed tokens (lookahead slot)" for k, b in enumerate(la)],
                               "marker": {"size": 14, "symbol": "square", "color": ORANGE}})
            gx, gy, gh, gc, gs = [], [], [], [], []
            dd, pdg = digests.get(("D", dreq, str(g)), {}), digests.get(("P", preq, str(g)), {})
            for j, (lb, rb) in enumerate(zip(lo, ro)):
                i = li.index(lb) + off if lb in li else j + (len(li) - len(lo)) + off
                tickvals.setdefault(i, f"{i}<br>D{lb}")
                exp = expected[i] if 0 <= i < len(expected) else None
                good = exp == rb
                mismatched += 0 if good else 1
                # the bytes D decodes on against P's block at the same token position (record --kv-checksum)
                same = None if str(lb) not in dd or str(exp) not in pdg else dd[str(lb)] == pdg[str(exp)]
                compared += same is not None
                differ += same is False
                gx.append(i)
                gy.append(rb)
                gc.append(GREEN if good and same is not False else RED)
                gs.append("circle" if good and same is not False else "x")
                gh.append(f"D block {lb} (logical {i}) ← P block {rb}<br>expected P block {exp}"
                          + ("" if good else "<br><b>MISMATCH</b>" + (" (P lookahead block)" if rb in la else ""))
                          + ("" if same is None else "<br>bytes: equal P's block (record --kv-checksum)" if same
                             else f"<br><b>bytes differ from P's block {exp}</b> (record --kv-checksum)"))
            if gx:
                traces.append({"type": "scatter", "mode": "markers", "name": f"actual pairing{gtag} (D {pe['ev']})",
                               "x": gx, "y": gy, "hovertext": gh, "hoverinfo": "text",
                               "marker": {"size": 11, "color": gc, "symbol": gs}})
                lx, ly = [], []
                for x, y in zip(gx, gy):
                    if 0 <= x < len(expected) and expected[x] != y:
                        lx += [x, x, None]
                        ly += [expected[x], y, None]
                if lx:
                    traces.append({"type": "scatter", "mode": "lines", "name": "shift (expected → actual)",
                                   "x": lx, "y": ly, "hoverinfo": "skip", "line": {"color": RED, "dash": "dot"}})
        affected = mismatched > 0 or differ > 0 or dreq in block_reqs or preq in block_reqs
        if not affected:
            ok_reqs.append(dreq)
            continue
        affected_total += 1
        if len(out) >= limit:
            continue
        title = (f"Block mapping: D {dreq} ← P {preq}: {mismatched} mismatched block(s), {lookahead} lookahead block(s) "
                 f"reported, remote_num_tokens {ntok}"
                 + (f"; bytes of {differ} of {compared} compared block(s) differ" if compared else ""))
        n_x = max([len(r) for r in reported] + [max(tickvals) + 1 if tickvals else 0, 1])
        for i in range(n_x):
            tickvals.setdefault(i, str(i))
        tv = sorted(tickvals)
        lay = layout(title, height=380, margin={"l": 70, "r": 20, "t": 40, "b": 60},
                         xaxis={"title": {"text": "logical block index (tick: D local block id)"}, "dtick": 1,
                                "range": [-0.5, n_x - 0.5],
                                "tickvals": tv or None, "ticktext": [tickvals[v] for v in tv] or None},
                         yaxis={"title": {"text": "remote (P) block id"}, "dtick": 1 if len(remote_in and remote_in[0]) < 30 else None})
        out.append((dreq, title, {"data": traces, "layout": lay}))
    note = (f"{affected_total} affected request(s) of {len(pairing)} KV transfer(s)" if pairing else
            "no NIXL read or trim recorded, so no pairing of D's blocks with P's to draw")
    if affected_total > limit:
        note += f"; the first {limit} are drawn, {affected_total - limit} more are listed in the findings table"
    if ok_reqs:
        note += f"; {len(ok_reqs)} transfer(s) pair every D block with the expected P block and are not drawn"
    return out, note
