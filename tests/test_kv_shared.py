"""Issue 50 item 1: a failed block shared by two requests, which vLLM lets one keep as computed
while the other recomputes it, read before the rewrite under chunked prefill.

Real parts: vLLM's Scheduler (the installed release: 0.32.0, or 0.33.0 in CI's second suite)
with its prefix cache, chunked prefill (long_prefill_token_threshold) and its whole failure path
(_handle_invalid_blocks -> _update_requests_with_invalid_blocks, policy recompute); simulated:
the worker's report of the failed blocks and the sampled tokens (pdtrace.testing.kv_shared_sim).
The oracle is vLLM's own objects: the scheduler's output per step and the first request's
num_computed_tokens against each failed block's place in its own block list.
"""

from __future__ import annotations

import pytest

from pdtrace.detectors import KV_LOAD_FAILURE_RECOVERY
from pdtrace.detectors.causes import group
from pdtrace.detectors.kv_load import detect

pytest.importorskip("vllm")


def _run(long_prefill):
    from pdtrace.testing.kv_shared_sim import shared_block_failure

    r = shared_block_failure(long_prefill)
    return r, [f for f in detect(r.events) if f.kind == KV_LOAD_FAILURE_RECOVERY]


def test_chunked_prefill_reads_the_shared_failed_block_before_its_rewrite():
    r, found = _run(16)
    # vLLM's own decision: the first request cut back to its first failed block, the second kept
    assert r.kept["shared-1-D"] == 16 and r.kept["shared-2-D"] > 64
    assert r.wrong, "vLLM's scheduler no longer schedules the second request before the rewrite"
    (f,) = found  # one finding: the second request, at the first step it attends a failed block
    assert (f.req, f.step, f.severity) == ("shared-2-D", min(s for _r, s in r.wrong), "error")
    assert f.data["recomputer"] == "shared-1-D" and set(f.data["blocks"]) <= set(r.failed)
    assert "_update_requests_with_invalid_blocks" in f.explanation and "None" not in f.title + f.explanation
    (c,) = group(found)
    assert c.mechanism == "kv-load/shared-block-read-early"


def test_the_same_run_without_the_threshold_is_clean():
    """vLLM's default: the first request recomputes the whole prefix in one step, written before
    that step's attention reads it: nothing read early, and pdtrace says nothing."""
    r, found = _run(0)
    assert r.kept["shared-2-D"] > 64 and r.wrong == []
    assert found == []
