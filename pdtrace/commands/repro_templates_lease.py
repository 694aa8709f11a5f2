"""The test `pdtrace repro --cause N` writes for P's expired NIXL lease (kv-never-crossed, vLLM #52234): plain
Python, no pdtrace import; the written file also carries ``repro_templates.HELPERS``.

What runs is vLLM's own: P's Scheduler with the NIXL connector's scheduler side (the lease's deadline, the blocks it
frees when the worker reports the request sent), the worker's own ``_reap_expired_send_leases`` where the release has
it (0.32 onward; before that the same lines sit inline in ``get_finished``, and the test says which it used), and D's
Scheduler with the connector planning its read from P's kv_transfer_params. No NIXL agent and no RDMA: the read is
the plan D's connector hands its worker, which is what the worker reads. This module holds text only."""

from __future__ import annotations

LEASE_DOC = '''"""Regression test for vLLM #52234's class (kv-never-crossed: P's NIXL lease ran out before D read),
written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; P (kv_producer) with {method_words}; block size {bs}; async_scheduling={async_}; P's request
{p_req} ({held_len}-token prompt, blocks {blocks}) held for D's read under a lease of {lease} s (P's
nixl.request_finished to its nixl.lease_expired), released with {retrieved} read notice(s) from D; P then gave
block(s) of it to {other} ({other_len}-token prompt); D's request {d_req} read P's blocks {after} after the release.

P prefills a prompt for a remote decode and holds its blocks for D's read under a lease (kv_lease_duration;
VLLM_NIXL_ABORT_REQUEST_TIMEOUT before 0.22). When the lease runs out before D's read notice, P's NIXL worker
reports the request sent (_reap_expired_send_leases) and P's scheduler frees the blocks; the next request P
schedules takes them. A request that reaches D later (a router or a queue held it longer than the lease) carries
P's kv_transfer_params, and D's connector plans its read of exactly those blocks: it reads another request's KV,
HTTP 200, and vLLM logs only on P ("Potentially invalid KV blocks for unrecognized request"). Must hold: the
blocks D's connector plans to read for the request are not held by another request on P, or D's plan carries P's
deadline for them (kv_transfer_params["remote_blocks_expiry_time"]), already past, so that D's worker declines the
read and recomputes, as vLLM does for the bidirectional turn-2 readback since PR #47021. Open upstream in every
release pdtrace installs (0.19.1-0.33.0): P exports the deadline only for blocks pinned on D
(https://github.com/vllm-project/vllm/issues/52234).

What runs is vLLM's own: P's Scheduler and the NIXL connector's scheduler side (the deadline and the freeing), P's
worker's _reap_expired_send_leases on the deadline the scheduler sent it (0.32 onward; before that the same lines
are inline in the worker's get_finished, which needs a NIXL agent, so the test reports the request whose deadline
passed as they do), and D's Scheduler planning the read. No NIXL agent, no model: the read is the plan D's
connector hands its worker. P's pool holds {num_blocks} blocks, so that the next request can be scheduled only on
the blocks the release frees (P's pool in the trace was larger; under load the next request takes them as well).
The block ids the test names are its own P's, not the trace's.
"""
'''

LEASE_TEST = '''

def _flat(ids):
    """A block list, one list per KV cache group or (before per-group lists) one list: every id, in order."""
    ids = list(ids or [])
    return [b for g in ids for b in g] if ids and isinstance(ids[0], (list, tuple)) else ids


def _release_at_expiry(deadlines):
    """What P's NIXL worker reports sent once the lease ran out: vLLM's own _reap_expired_send_leases where this
    release has it, on a worker carrying only what that method reads (the deadlines the scheduler sent, the requests
    in a batch, no read notice counted); else the requests whose deadline passed, as the inline lines of the older
    releases' get_finished add them. Returns (the set, which code gave it)."""
    import collections
    import time

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker as W
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    except ImportError:
        W = None
    if W is None or not hasattr(W, "_reap_expired_send_leases"):
        now = time.perf_counter()
        return {r for r, t in deadlines.items() if now >= t}, "the inline expiry of this release's get_finished"
    w = object.__new__(W)
    w._reqs_to_send = dict(deadlines)
    w._reqs_to_process = set(deadlines)  # (start_load_kv put them there: they were in a batch)
    w.consumer_notification_counts_by_req = collections.defaultdict(int)  # (D sent no read notice)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = NixlKVConnectorStats()
    done = set()
    W._reap_expired_send_leases(w, done)
    return done, "NixlBaseConnectorWorker._reap_expired_send_leases"


def test_p_gives_no_block_d_will_read_to_another_request(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", str(LEASE_S))  # (the lease before kv_lease_duration)
    p = _scheduler(tmp_path, "kv_producer", num_blocks=NUM_BLOCKS, max_model_len=(NUM_BLOCKS - 1) * BLOCK_SIZE,
                   extra_config={"kv_lease_duration": LEASE_S})
    held_prompt = _prompt(HELD_LEN)
    params = _prefill_on_p(p, HELD, held_prompt)
    p.add_request(_request(OTHER, _prompt(OTHER_LEN, seed=1), 8))  # (it runs on: its blocks stay its own)
    out, _ = _step(p, {OTHER: 100})  # (OTHER waits: the pool's free blocks are too few while HELD's are held)
    deadlines = dict(getattr(out.kv_connector_metadata, "reqs_to_send", None) or {})
    assert HELD in deadlines, f"P's connector sent its worker no lease for {HELD}: the situation was not rebuilt"
    time.sleep(max(0.0, deadlines[HELD] - time.perf_counter()) + 0.05)  # the lease runs out, D has not read
    done, by = _release_at_expiry(deadlines)  # (a P that keeps HELD's blocks until D's notice releases nothing)
    _step(p, {OTHER: 100}, finished_sending=done)  # P's scheduler frees what was released
    _step(p, {OTHER: 100})  # and schedules OTHER where it can
    assert OTHER in p.requests, f"P did not keep {OTHER}: the situation was not rebuilt"
    other = set(_flat(p.kv_cache_manager.get_block_ids(OTHER)))

    d = _scheduler(tmp_path, "kv_consumer")  # the request reaches D after the release, with P's params
    d.add_request(_request(D_REQ, held_prompt, 4, dict(params)))
    out, _ = _step(d)
    recv = getattr(out.kv_connector_metadata, "reqs_to_recv", None) or {}
    assert D_REQ in recv, "D's connector planned no read for the request: the situation was not rebuilt"
    remote = getattr(recv[D_REQ], "remote", None)
    reads = _flat(remote.block_ids if remote is not None else recv[D_REQ].remote_block_ids)
    deadline = getattr(remote, "blocks_expiry_time", None) if remote is not None else None
    taken = sorted(set(reads) & other)
    declined = deadline is not None and time.perf_counter() >= deadline
    assert not taken or declined, (
        f"P's lease on {HELD} ({LEASE_S} s) ran out before D's read ({by} released it with no read notice), P's "
        f"scheduler gave block(s) {taken} to {OTHER}, and D's connector still plans to read P's blocks {reads} "
        f"for {D_REQ} with no deadline to decline it by (remote_blocks_expiry_time={deadline}): D decodes on "
        f"{OTHER}'s KV, HTTP 200 (vLLM #52234)")
'''
