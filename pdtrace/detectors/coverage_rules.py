"""The configuration rules of ``coverage.CLASSES``: predicates on one ``sched.config`` that, true for every
recorded scheduler, say a bug class cannot occur there (re-exported by ``coverage``)."""

from __future__ import annotations

from typing import Any

from .index import is_attention_group

Event = dict[str, Any]

# spec methods whose drafter has no KV cache of its own (vLLM 0.32.0 accepted_counts.NO_KV_METHODS)
NO_KV_DRAFTERS = frozenset({"", "ngram", "ngram_gpu", "suffix", "medusa", "extract_hidden_states"})
SAVING_ROLES = frozenset({"kv_producer", "kv_both"})
LOADING_ROLES = frozenset({"kv_consumer", "kv_both"})


def _no_spec(c: Event) -> bool:
    return not c.get("num_spec_tokens")


def _no_lookahead(c: Event) -> bool:
    return not c.get("num_lookahead_tokens")


def _no_connector(c: Event) -> bool:
    return not c.get("connector") and not c.get("kv_role")


def _no_kv_drafter(c: Event) -> bool:
    return _no_spec(c) or (c.get("spec_method") or "") in NO_KV_DRAFTERS


def _not_saving(c: Event) -> bool:
    return (c.get("kv_role") or "") not in SAVING_ROLES


def _not_loading(c: Event) -> bool:
    return (c.get("kv_role") or "") not in LOADING_ROLES


def _no_state_group(c: Event) -> bool:
    return all(is_attention_group(k) for k in (c.get("group_kinds") or []))
