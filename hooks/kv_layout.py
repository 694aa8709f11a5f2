"""The KV cache groups as vLLM built them, for ``sched.config`` (hooks/scheduler.py): what the
detectors need to read the NIXL connector's per-group block lists the way that release builds
them (vllm.v1.kv_cache_interface: ``SlidingWindowSpec.sliding_window``,
``ChunkedLocalAttentionSpec.attention_chunk_size``, ``KVCacheConfig.transfer_group_ids``,
``KVCacheGroupSpec.is_eagle_group`` / ``KVCacheSpec.is_draft`` (the drafter's groups); the
connector scheduler's ``blocks_per_sw`` and ``_is_hma_required``). Every field is read where the
release has it and left out where it does not; nothing here re-derives a rule.
"""

from __future__ import annotations

from typing import Any


def group_layout(groups: list, kv_cache_config: Any, conn: Any) -> dict:
    """What the detectors need to read the connector's per-group block lists as vLLM builds them:
    each group's window (sliding window / attention chunk, tokens), the transfer groups (the
    groups the connector exchanges, in order), and the connector's own in-window tail per
    transfer group (its ``blocks_per_sw``), each where this release has it."""
    out: dict[str, Any] = {}
    wins = []
    for g in groups:
        spec = g.kv_cache_spec
        w = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None) or 0
        wins.append(int(w) if isinstance(w, int) else 0)
    if any(wins):
        out["windows"] = wins
    # the groups vLLM marks as holding the drafter's (EAGLE / MTP) layers: KVCacheGroupSpec.is_eagle_group
    # (0.2x+), or a spec whose layers a draft model owns (KVCacheSpec.is_draft, 0.33): with
    # transfer_group_ids, what says whether a transfer fills the drafter's KV on D (vLLM #54926)
    draft = [i for i, g in enumerate(groups)
             if getattr(g, "is_eagle_group", False) is True or getattr(g.kv_cache_spec, "is_draft", False) is True]
    if draft:
        out["draft_groups"] = draft
        # the layers a finding names (a few per group: an MTP drafter's group can hold dozens)
        out["draft_layers"] = [[str(n) for n in list(groups[i].layer_names)[:4]] for i in draft]
    tg = getattr(type(kv_cache_config), "transfer_group_ids", None)
    if tg is not None:
        try:
            ids = [int(i) for i in kv_cache_config.transfer_group_ids]
        except Exception:  # noqa: BLE001 - a release whose property needs more than the config
            ids = None
        if ids is not None and ids != list(range(len(groups))):
            out["transfer_group_ids"] = ids
    cs = getattr(conn, "connector_scheduler", None) if conn is not None else None
    bps = getattr(cs, "blocks_per_sw", None) if cs is not None else None
    if isinstance(bps, (list, tuple)) and all(isinstance(x, int) for x in bps) and any(bps):
        # only meaningful where the connector clips at all (its HMA switch; absent: it always does)
        if getattr(cs, "_is_hma_required", True):
            out["exchange_blocks"] = [int(x) for x in bps]
        else:
            out["exchange_blocks"] = [0] * len(bps)
    return out


def step_budget(sched_cfg: Any) -> dict:
    """The scheduler's per-step token budget and its long-prefill chunk (``SchedulerConfig.max_num_batched_tokens``,
    ``long_prefill_token_threshold``: 0 = no chunking of a long prefill), where the release has them: what a rebuilt
    situation needs to chunk a recompute as the recording did (`pdtrace repro`)."""
    out: dict[str, int] = {}
    for name in ("max_num_batched_tokens", "long_prefill_token_threshold"):
        v = getattr(sched_cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            out[name] = int(v)
    return out
