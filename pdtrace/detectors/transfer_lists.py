"""The per-group block lists of a P->D transfer as vLLM's connector builds them (``transfers``' helpers):
group block sizes and kinds from the emitting scheduler's config, D's load list, the end-trim pairing and the
pairs D's reads name."""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]
NULL_BLOCK = 0  # vLLM's BlockPool hands out block 0 as its null block (padding, never KV to load)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) if block_size > 0 else 0


_TAIL_MARKERS = ("SlidingWindow", "ChunkedLocal")  # groups whose exchanged lists are in-window tails


def _kv_group(config: Event | None, g: int) -> int:
    """The KV cache group behind the connector's ``g``-th per-group list: the connector's lists
    follow the transfer groups (``sched.config.transfer_group_ids``; absent: every group)."""
    tg = (config or {}).get("transfer_group_ids")
    return int(tg[g]) if tg and g < len(tg) else g


def group_block_size(config: Event | None, g: int) -> int:
    sizes = (config or {}).get("block_sizes") or [16]
    k = _kv_group(config, g)
    return int(sizes[k] if k < len(sizes) else sizes[-1])


def group_kind(config: Event | None, g: int) -> str:
    kinds = (config or {}).get("group_kinds") or []
    k = _kv_group(config, g)
    return kinds[k] if k < len(kinds) else ""


def is_tail_group(kind: str) -> bool:
    """Sliding-window / chunked-local groups: only their tail holds KV (vLLM pads the rest with null
    blocks). Of these the NIXL connector cuts only sliding-window groups' lists to the tail when it
    exchanges them (``blocks_per_sw``); a chunked group's list goes whole, nulls included."""
    return any(m in kind for m in _TAIL_MARKERS)


def load_list(a: Event, config: Event | None) -> tuple[list[list[int]], list[bool]]:
    """The blocks D loads into, per transfer group, and per group whether that list is exact.

    Recorded by the hook (``load_block_ids``: the connector's own derivation) where the trace
    has it. Else derived from D's whole list as vLLM's ``update_state_after_alloc`` does: the
    transfer groups only, no null blocks (padding for out-of-window positions), and a tail group cut
    as the connector cuts it (``exchange_blocks``; else a sliding-window group by the
    ``cdiv(window, block_size) + 1`` rule from its recorded window). The derived list
    still holds D's own prefix-cache hits (their hashes are not recorded), and a tail group whose
    cut the trace does not say is not exact."""
    rec = a.get("load_block_ids")
    if rec is not None:
        return [list(x) for x in rec], [True] * len(rec)
    full = a.get("local_block_ids") or []
    tg = (config or {}).get("transfer_group_ids")
    if tg and len(full) > len(tg):  # D's whole list is per KV cache group: the transfer groups' lists
        full = [full[i] for i in tg if i < len(full)]
    cut = (config or {}).get("exchange_blocks") or []
    wins = (config or {}).get("windows") or []
    out, exact = [], []
    for g, lo in enumerate(full):
        lo = [b for b in lo if b != NULL_BLOCK]
        ok = True
        if is_tail_group(group_kind(config, g)):
            k = _kv_group(config, g)
            n = cut[g] if g < len(cut) else None
            if n is None and k < len(wins) and wins[k] and "SlidingWindow" in group_kind(config, g):
                n = blocks_needed(int(wins[k]), group_block_size(config, g)) + 1
            if n:
                lo = lo[-n:]
            ok = n is not None
        out.append(lo)
        exact.append(ok)
    return out, exact


def end_trim(local: list[int], remote: list[int]) -> list[tuple[int, int]]:
    """D's ``_apply_prefix_caching`` for one token-indexed group: keep ``remote[-n_local:]``."""
    n = len(local)
    if n == 0:
        return []
    if n < len(remote):
        remote = remote[-n:]
    return list(zip(local, remote))


def _pairs_from_reads(reads: list[Event], ngroups: int) -> list[list[tuple[int, int]]]:
    if len(reads) == 1:  # the usual case: one read, no local block twice in a group
        r = reads[0]
        groups = list(zip(r.get("local_block_ids") or [], r.get("remote_block_ids") or []))
        if all(len(set(ls)) == len(ls) for ls, _rs in groups):
            pairs: list[list[tuple[int, int]]] = [list(zip(ls, rs)) for ls, rs in groups]
            pairs.extend([] for _ in range(ngroups - len(groups)))
            return pairs
    out: list[list[tuple[int, int]]] = [[] for _ in range(ngroups)]
    seen: list[set[int]] = [set() for _ in range(ngroups)]
    for r in reads:
        for g, (ls, rs) in enumerate(zip(r.get("local_block_ids") or [], r.get("remote_block_ids") or [])):
            if g >= ngroups:
                out.append([])
                seen.append(set())
                ngroups += 1
            for lb, rb in zip(ls, rs):
                if lb not in seen[g]:
                    seen[g].add(lb)
                    out[g].append((lb, rb))
    return out
