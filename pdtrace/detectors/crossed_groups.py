"""kv-never-crossed per KV cache group (issue 51): of the prompt tokens D's connector loaded, how
many reached each of D's KV cache groups.

vLLM's scheduler keeps one ``num_computed_tokens`` per request: D's prefix-cache hit and the
tokens it computes itself are the same in every group (the hit is the one all groups share). What
differs per group is the load. The connector hands its worker one list of blocks per transfer
group (``nixl.remote_alloc.load_block_ids``, the connector's own derivation; for a trace without
it, derived from D's whole list as the release derives it: ``transfer_lists.load_list``), so for
the loaded range ``[hit, hit + loaded)`` of a request and group ``g``:

- not a transfer group (``sched.config.transfer_group_ids`` recorded without it): nothing loaded;
  the tokens are ``not_transferred`` (a drafter's group there is vLLM #54926's shape, flagged by
  ``crossed``; HiSparse's hot / resident groups D derives from a transferred one);
- a state group (Mamba): its state covers the whole range when a block of it loads;
- a token group: the last ``n`` blocks covering the range are the ``n`` it loads; the tokens before
  them are ``not_loaded`` (for a sliding-window or chunked-local group: outside the window, never
  read again). ``blocks`` counts the blocks loaded, ``derived`` the requests whose list was derived
  (not recorded), ``inexact`` those whose tail cut the trace does not say (counted as loaded whole).
"""

from __future__ import annotations

from .index import is_attention_group
from .transfer_lists import is_tail_group, load_list

FIELDS = ("requests", "loaded", "not_loaded", "not_transferred", "blocks", "derived", "inexact")


def groups_of(c: dict) -> list[dict]:
    """The KV cache groups of scheduler config ``c``: index, kind, block size, whether it transfers
    (``transfer_group_ids``; absent: every group) and its position among the transfer groups, and
    whether vLLM marks it as the drafter's (``draft_groups``)."""
    sizes, kinds = c.get("block_sizes") or [], c.get("group_kinds") or []
    tg = c.get("transfer_group_ids")
    draft = set(c.get("draft_groups") or ())
    out = []
    for g in range(max(len(sizes), len(kinds))):
        kind = str(kinds[g]) if g < len(kinds) else ""
        ti = (list(tg).index(g) if g in tg else None) if tg is not None else g
        out.append({"group": g, "kind": kind, "block_size": int(sizes[g] if g < len(sizes) else sizes[-1] if sizes else 16),
                    "transfer": ti is not None, "ti": ti, "draft": g in draft,
                    "state": not is_attention_group(kind), "tail": is_tail_group(kind)})
    return out


def per_group(groups: list[dict], config: dict, alloc: dict | None, local: int, tokens: int) -> list[dict]:
    """For one request: per group, the tokens of ``[local, local + tokens)`` loaded from P, not
    loaded (before the loaded tail), not transferred, and the blocks loaded. ``alloc`` is D's
    ``nixl.remote_alloc`` of the request (None: not recorded; every transfer group counted whole)."""
    lists, exact = load_list(alloc, config) if alloc is not None else ([], [])
    end = local + tokens
    out = []
    for gi in groups:
        row = {"loaded": 0, "not_loaded": 0, "not_transferred": 0, "blocks": 0, "derived": 0, "inexact": 0}
        if tokens <= 0:
            pass
        elif not gi["transfer"]:
            row["not_transferred"] = tokens
        elif gi["ti"] is None or gi["ti"] >= len(lists):
            row["loaded"] = tokens  # (no load list in the trace: as vLLM counts it, the whole range)
        else:
            n = len(lists[gi["ti"]])
            row["blocks"] = n
            row["derived"] = int(alloc is not None and alloc.get("load_block_ids") is None)
            row["inexact"] = int(not exact[gi["ti"]])
            if gi["state"]:
                row["loaded"] = tokens if n else 0
            else:
                bs = gi["block_size"] or 16
                first = (-(-end // bs) - n) * bs  # the first position the last n blocks cover
                row["loaded"] = max(0, min(tokens, end - max(local, first)))
            row["not_loaded"] = tokens - row["loaded"]
        out.append(row)
    return out


def add(acc: dict, groups: list[dict], rows: list[dict]) -> None:
    """Sum one request's ``per_group`` rows into a pair's ``acc`` (group index -> totals)."""
    for gi, row in zip(groups, rows):
        a = acc.setdefault(gi["group"], {"group": gi["group"], "kind": gi["kind"], "block_size": gi["block_size"],
                                         "transfer": gi["transfer"], "draft": gi["draft"], "tail": gi["tail"],
                                         **{k: 0 for k in FIELDS}})
        a["requests"] += 1
        for k, v in row.items():
            a[k] += v


def notes(acc: dict) -> list[dict]:
    return [acc[g] for g in sorted(acc)]


def name(r: dict) -> str:
    """``group 1 (FullAttention, drafter)``."""
    kind = r["kind"].replace("Spec", "") or "kind not recorded"
    return f"group {r['group']} ({kind}{', drafter' if r.get('draft') else ''})"


def line(r: dict) -> str:
    """One group of a pair in words (``check``)."""
    total = r["loaded"] + r["not_loaded"] + r["not_transferred"]
    if not total:
        return f"{name(r)}: nothing loaded"
    head = f"{name(r)}: {r['loaded'] or 'none'} of the {total} loaded token(s) reached it"
    if r["blocks"]:
        head += f" ({r['blocks']} block(s))"
    if r["not_transferred"]:
        head += ("; not a transfer group: D's scheduler counts them as done, yet no load and no forward on D "
                 "wrote them" + (" (the drafter's group: flagged, vLLM #54926's shape)" if r.get("draft") else ""))
    if r["not_loaded"]:
        head += (f"; {r['not_loaded']} before its loaded tail" + (" (outside the window the connector moves; "
                                                                  "whether a step still reads them, the KV "
                                                                  "invariant judges)" if r.get("tail") else ""))
    if r["inexact"]:
        head += f"; {r['inexact']} request(s) with a tail cut the trace does not say (counted whole)"
    return head


def lines(groups: list[dict]) -> list[str]:
    """A pair's groups in a few lines (``check``): none for one group (the pair's line says it all); one
    line when every group got every loaded token; else a line per group that did not, and one for the rest."""
    if len(groups) < 2 or not any(r["loaded"] + r["not_loaded"] + r["not_transferred"] for r in groups):
        return []
    short_of = [r for r in groups if r["not_loaded"] or r["not_transferred"] or r["inexact"]]
    whole = [r for r in groups if r not in short_of]
    out = [line(r) for r in short_of]
    if whole:
        out.append(("every KV cache group got every loaded token: " if not short_of else "every loaded token reached ")
                   + ", ".join(name(r) for r in whole))
    return out
