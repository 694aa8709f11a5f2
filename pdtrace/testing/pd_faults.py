"""The labelled faults of ``pd_harness`` (test fixtures, never production): the pre-fix vLLM
rules put back on the real code path, each emitting a ``fault.inject`` event, so a buggy
and a fixed trace come from the same run side by side."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from pdtrace.record import recorder as _recorder
from pdtrace.record.recorder import Recorder


# ---------------------------------------------------------------------------------------
# fault injection (fixtures: re-introduce old vLLM rules on the real code path)
# ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def old_p_block_rule(scheduler: Any, rec: Recorder | None = None) -> Iterator[None]:
    """FAULT: P reports its full allocation (lookahead blocks included).

    0.32.0's ``Scheduler._connector_finished`` takes the block ids it hands to the
    connector from ``kv_cache_manager.get_block_ids_for_computed_tokens(request_id,
    num_computed_tokens)`` (clipped per attention group to cdiv(num_computed, block_size)).
    Before the upstream fix it used ``kv_cache_manager.get_block_ids(request_id)``. This
    patches exactly that call on this scheduler's manager instance.
    """
    kvm = scheduler.kv_cache_manager
    (rec or _recorder.get() or Recorder.in_memory(role="engine-core")).emit(
        "fault.inject", rule="p-sends-full-allocation", sim=True,
        inst=getattr(scheduler, "_pdtrace_inst", "P"),
        detail="Scheduler._connector_finished: kv_cache_manager.get_block_ids_for_computed_tokens -> "
               "get_block_ids (pre-fix rule: P reports lookahead blocks beyond its computed tokens)")

    def full_allocation(request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        return kvm.get_block_ids(request_id)

    kvm.get_block_ids_for_computed_tokens = full_allocation
    try:
        yield
    finally:
        del kvm.get_block_ids_for_computed_tokens  # back to the class method


@contextlib.contextmanager
def old_dflash_lookahead(scheduler: Any, rec: Recorder | None = None, variant: str = "k") -> Iterator[None]:
    """FAULT (seed 003): DFlash reserves too few lookahead slots.

    0.32.0's ``VllmConfig.num_lookahead_tokens`` is k+1 for DFlash (one bonus query plus
    one query per draft token) and the scheduler copies it into
    ``Scheduler.num_lookahead_tokens``, which every ``allocate_slots`` call uses (subject
    to the P/D rule: 0 while a remote KV load is pending). ``variant="k"`` restores the
    EAGLE-style k slots; ``variant="zero"`` reserves none (the first-prefill bug).
    """
    if variant not in ("k", "zero"):
        raise ValueError("variant must be 'k' or 'zero'")
    old = scheduler.num_lookahead_tokens
    new = scheduler.num_spec_tokens if variant == "k" else 0
    (rec or _recorder.get() or Recorder.in_memory(role="engine-core")).emit(
        "fault.inject", rule="dflash-lookahead-" + variant, sim=True,
        inst=getattr(scheduler, "_pdtrace_inst", "-"),
        detail=f"Scheduler.num_lookahead_tokens {old} -> {new} (DFlash needs k+1 = {scheduler.num_spec_tokens + 1})")
    scheduler.num_lookahead_tokens = new
    try:
        yield
    finally:
        scheduler.num_lookahead_tokens = old


FAULTS = ("old_p_block_rule", "old_dflash_lookahead")
