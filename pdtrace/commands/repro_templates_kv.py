"""The text of `pdtrace repro --cause N`'s tests for the KV-load failure classes (issue 61): a KV load rollback that
leaves async output placeholders (vLLM #49250 / #45138), and failed blocks shared through D's prefix cache read before
they are rewritten; the KV invariant's in-flight write and read (vLLM #37285, #47282); the drafter's KV cache group
left out of the transfer (vLLM #54926's shape). Plain Python over ``repro_templates.HELPERS``; this module holds text only."""

from __future__ import annotations

ROLLBACK_DOC = '''"""Regression test for vLLM #49250 / #45138 (kv-load-failure-recovery: placeholders), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; async_scheduling={async_}; block size {bs}; D request {req}: a {prompt_len}-token prompt loaded
from P, max_tokens {max_tokens}; after it ran, block index(es) {failed} (positions in its block list, from 0) of its {n_blocks} KV block(s) were reported
failed (KVConnectorOutput.invalid_block_ids), kv_load_failure_policy "recompute"; it carried {placeholders} output
placeholder(s) then. This test rebuilds the step-by-step order (each output fed before the next schedule), where one
placeholder is left: the same rule, whatever the count (a step in flight in the engine core's order leaves more).

When a running request's loaded blocks are reported invalid, the scheduler cuts its num_computed_tokens back to the
first failed block (_update_requests_with_invalid_blocks) and recomputes from there. Under async scheduling the
request still carries num_output_placeholders for the token of the step in flight; if they are not rolled back with
the computed tokens, the next schedule() gives the request more tokens than it has left to compute (its num_tokens
less its computed tokens): the recompute runs past the request, and the request can stall in the running queue.
Open upstream: https://github.com/vllm-project/vllm/issues/49250 and
https://github.com/vllm-project/vllm/issues/45138 (PRs #45430 / #49252 reset the placeholders; not merged in any
release pdtrace installs, so this test fails on every one of them, 0.19.1-0.33.0, until the fix lands).

Runs with pytest and vLLM alone, on CPU: the real AsyncScheduler, KV cache manager and NixlConnector scheduler side of
P and D, the scheduler's own failure path. What is written by hand, as vLLM's own tests do: the worker's
ModelRunnerOutput (the sampled tokens, the load finishing, the failed blocks in invalid_block_ids).
"""
'''

ROLLBACK_TEST = '''

def test_a_kv_load_rollback_schedules_no_more_than_the_request_has_left(tmp_path):
    d, _req = _loaded_on_d(tmp_path, P_REQ, D_REQ, PROMPT_LEN, MAX_TOKENS)
    local = list(d.kv_cache_manager.get_block_ids(D_REQ)[0])  # the blocks the load filled
    _step(d, {D_REQ: 300})  # the request runs a step
    failed = {local[i] for i in FAILED_BLOCK_INDEXES if i < len(local)}
    _step(d, {D_REQ: 301}, invalid_block_ids=failed)  # its loaded blocks are reported invalid
    held = list(d.kv_cache_manager.get_block_ids(D_REQ)[0])  # its blocks when the failure was handled
    req = d.requests[D_REQ]
    cut, total = req.num_computed_tokens, req.num_tokens  # right after the failure was handled
    left = total - cut
    placeholders = getattr(req, "num_output_placeholders", 0)
    out, _ = _step(d, {D_REQ: 302})
    got = out.num_scheduled_tokens.get(D_REQ, 0)
    assert got <= left, (
        f"after block(s) {sorted(failed)} of {D_REQ} (its D blocks {held}) failed to load, the scheduler cut it "
        f"back to {cut} computed tokens of {total}, {left} left to compute; the next schedule() "
        f"gave it {got}, {got - left} past its tokens: it still carried {placeholders} output placeholder(s) of "
        f"async scheduling, not rolled back with its computed tokens (vLLM #49250 / #45138)")
'''

SHARED_DOC = '''"""Regression test for a failed KV load shared through D's prefix cache (kv-load-failure-recovery: shared block read early), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; async_scheduling={async_}; block size {bs}; on D: {r1} ({r1_len}-token prompt) prefilled
first, then {r2} ({r2_len} tokens) took the first {shared} tokens' blocks from D's prefix cache; block index(es)
{failed} (positions from 0) of {r1}'s block list, shared with {r2}, were reported failed (invalid_block_ids), policy "recompute"; the
recompute ran in chunks of {chunk} token(s) (long_prefill_token_threshold {chunk}, as the recorded steps show it)
and steps of at most {budget} tokens.

The scheduler cuts {r1} back to its first failed block and recomputes it; {r2} keeps the same blocks as computed
(_update_requests_with_invalid_blocks marks only the first request that holds a block for recompute). A step that
schedules {r2} before {r1}'s recompute has rewritten every failed block {r2} keeps makes {r2} attend to the failed
load's KV: garbage, silently. With vLLM's default scheduler config the recompute runs in one step and nothing is
read early; a long_prefill_token_threshold chunks it. Not fixed in any release pdtrace installs (0.30.0-0.33.0
reach this shape; before 0.30.0 the second request did not get the first's blocks from the prefix cache in this
situation).

Runs with pytest and vLLM alone, on CPU: the real Scheduler, KV cache manager with its prefix cache and the
NixlConnector scheduler side of D. What is written by hand, as vLLM's own tests do: the worker's ModelRunnerOutput
(the sampled tokens, the failed blocks in invalid_block_ids).
"""
'''

SHARED_TEST = '''

def test_a_request_sharing_failed_blocks_is_not_scheduled_before_they_are_recomputed(tmp_path):
    d = _scheduler(tmp_path, "kv_consumer", policy="recompute", long_prefill=CHUNK,
                   max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    prefix = _prompt(SHARED_TOKENS)
    r1 = _request(R1, prefix + [5000 + i for i in range(R1_LEN - SHARED_TOKENS)], R1_MAX_TOKENS)
    r2 = _request(R2, prefix + [7000 + i for i in range(R2_LEN - SHARED_TOKENS)], R2_MAX_TOKENS)
    tok = iter(range(300, 100000))

    def step(**kvo):
        return _step(d, {rid: next(tok) for rid in list(d.requests)}, **kvo)[0]

    d.add_request(r1)
    for _ in range(16):
        if d.requests[R1].num_computed_tokens >= R1_LEN:
            break
        step()
    d.add_request(r2)
    for _ in range(STEPS_BEFORE_FAILURE):
        step()
    b1 = list(d.kv_cache_manager.get_block_ids(R1)[0])
    b2 = list(d.kv_cache_manager.get_block_ids(R2)[0])
    shared = [b for b in b1 if b in b2]
    if not shared:  # (before 0.30.0 r2 prefilled them itself in this situation: no block is shared)
        pytest.skip(f"{R2} got none of {R1}'s blocks from this vLLM's prefix cache ({b1}, {b2}): no shared block")
    failed = [b1[i] for i in FAILED_BLOCK_INDEXES if i < len(b1)]
    step(invalid_block_ids=set(failed))
    kept = d.requests[R2].num_computed_tokens
    for n in range(1, 9):
        out = step()
        if R1 not in d.requests or R2 not in d.requests:
            break
        # r1's computed tokens after this step's schedule(): what it has rewritten by the time this step's attention
        # reads (a step writes its tokens' KV before attending)
        c1 = d.requests[R1].num_computed_tokens
        stale = [b for i, b in enumerate(b2) if b in failed and i * BLOCK_SIZE < kept
                 and c1 < (b1.index(b) + 1) * BLOCK_SIZE]
        assert not (R2 in out.num_scheduled_tokens and stale), (
            f"step {n} after the failure scheduled {R2}, which keeps block(s) {stale} as computed ({kept} computed "
            f"tokens), while {R1}, which recomputes them, had rewritten only its first {c1} tokens (blocks of "
            f"{BLOCK_SIZE}, its blocks {b1}): {R2} attends to the failed load's KV in block(s) {stale}")
'''

REOWN_DOC = '''"""Regression test for vLLM #37285 (kv-invariant: a KV load into blocks a step in flight still writes), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; async_scheduling={async_}; block size {bs}; D's pool of {num_blocks} blocks (the null block
included); on D, request {a} ({a_len}-token prompt) stopped at its output token {stop_at} (a stop token, as an EOS
does) while its next step was in flight; then request {b} arrived to load {b_len} prompt tokens from P ({p}).

Under async scheduling the engine core (EngineCore.step_with_batch_queue, a batch queue of two) schedules step n+1
before it processes step n's output. When step n's output finishes a request A, step n+1 is already in flight and
writes A's next position into A's last block. If A's blocks go back to the pool at once, the next schedule() can
hand them to a request B that loads its KV from P: B's NIXL read lands by RDMA, unordered against step n+1's write,
and B decodes on a block holding A's KV (GSM8K 0.11-0.48 against 0.85 in
https://github.com/vllm-project/vllm/issues/37285). Releases 0.19.0-0.23.0 free at once; PR #45357 (0.24.0) defers
the return of a freed request's blocks until the steps in flight when it was freed have had their outputs processed.

Runs with pytest and vLLM alone, on CPU: the real AsyncScheduler, KV cache manager, block pool and NixlConnector
scheduler side of D and P. What is written by hand: the engine core's order (schedule, then feed the oldest output
once two are queued) and the worker's ModelRunnerOutput (the sampled tokens); the GPU write and the NIXL read do not
run: the test asserts on vLLM's block lists which (block, offset) the in-flight step writes and B's load fills.
"""
'''

REOWN_TEST = '''

def test_a_kv_load_gets_no_block_a_step_in_flight_still_writes(tmp_path):
    kw = dict(num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
              max_num_batched_tokens=max(MAX_MODEL_LEN, 64))
    p = _scheduler(tmp_path, "kv_producer", **kw)
    d = _scheduler(tmp_path, "kv_consumer", **kw)
    stop = 9999
    a = _request(A_REQ, [700 + i for i in range(A_LEN)], A_MAX_TOKENS, stop_token_ids=[stop])
    d.add_request(a)
    writes = {}  # step -> {(block, offset)} its forward writes for A (A's own block list, its scheduled positions)
    processed, outputs, b_added = set(), 0, False
    for _i, kind, out, step, queue in _engine_order(d, 4 * (A_MAX_TOKENS + 4)):
        if kind == "scheduled":
            if A_REQ in out.num_scheduled_tokens and A_REQ in d.requests:
                n, c = out.num_scheduled_tokens[A_REQ], a.num_computed_tokens  # (schedule() advanced it)
                ids = d.kv_cache_manager.get_block_ids(A_REQ)[0]
                writes[step] = _slots(ids, range(c - n, c))
            if b_added and B_REQ in d.requests and d.kv_cache_manager.get_block_ids(B_REQ)[0]:
                b_ids = list(d.kv_cache_manager.get_block_ids(B_REQ)[0])
                loads = _slots(b_ids, range(B_LEN))  # what NIXL fills
                pending = sorted(s for _o, s in queue if s not in processed and s in writes)
                hit = sorted(loads & set().union(*(writes[s] for s in pending))) if pending else []
                assert not hit, (
                    f"{B_REQ} was handed blocks {b_ids} to load {B_LEN} prompt tokens from P while step(s) {pending}, "
                    f"still in flight (their outputs not processed), write {A_REQ}'s KV at (block, offset) {hit}: "
                    f"{A_REQ} stopped with those steps in flight and its blocks went back to the pool at once; the "
                    f"NIXL read and that write are unordered (vLLM #37285, fixed by PR #45357)")
                return
            continue
        toks = {}
        if A_REQ in out.num_scheduled_tokens and A_REQ in d.requests:
            outputs += 1
            toks = {A_REQ: stop if outputs == STOP_AT else 900 + step}
        _feed(d, out, toks)
        processed.add(step)
        if not b_added and (A_REQ not in d.requests or a.is_finished()):
            prompt = [1700 + i for i in range(B_LEN)]
            params = _prefill_on_p(p, P_REQ, prompt)
            d.add_request(_request(B_REQ, prompt, 8, dict(params)))
            b_added = True
    pytest.fail(f"{B_REQ} was never allocated: the situation was not rebuilt")
'''

PRUNE_DOC = '''"""Regression test for vLLM #47282 (kv-invariant: a pruned sliding-window block a step in flight still reads, handed to a KV load), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; async_scheduling={async_}; one sliding-window group of {window} tokens, block size {bs}; D's
pool of {num_blocks} blocks (the null block included); on D, request {a} ({a_len}-token prompt) decodes; request
{b} arrives to load {b_len} prompt tokens from P ({p}) as the next schedule() prunes a block of {a}'s window.

Under async scheduling schedule() advances a request's num_computed_tokens past the tokens it just scheduled,
before that step has run. The next schedule() (step n+1, with step n in flight) frees the blocks outside the sliding
window by that optimistic count: the block holding the first position step n's window reads leaves the request while
step n still attends to it. Back in the pool, it can be handed to a request that loads its KV from P, whose NIXL read
lands unordered against step n's attention, which then reads another prompt's KV
(https://github.com/vllm-project/vllm/issues/47282; vllm-ascend #13501). Releases 0.19.0-0.25.x prune by the
optimistic count; PR #47728 (0.26.0) prunes by the processed count (num_computed_tokens less the tokens in flight).

Runs with pytest and vLLM alone, on CPU: the real AsyncScheduler, KV cache manager (its sliding-window pruning),
block pool and NixlConnector scheduler side of D and P. What is written by hand: the engine core's order (schedule,
then feed the oldest output once two are queued) and the sampled tokens; no attention kernel and no NIXL read run:
the test asserts on vLLM's block lists which (block, offset) an in-flight step's window reads and B's load fills.
"""
'''

PRUNE_TEST = '''

def test_a_kv_load_gets_no_block_a_step_in_flight_still_reads(tmp_path):
    steps = A_MAX_TOKENS
    n_a = _cdiv(A_LEN + steps + 2, BLOCK_SIZE)
    kw = dict(num_blocks=NUM_BLOCKS, max_model_len=n_a * BLOCK_SIZE + 64, max_num_seqs=4,
              max_num_batched_tokens=max(n_a * BLOCK_SIZE, 128))
    p = _scheduler(tmp_path, "kv_producer", **kw)
    d = _scheduler(tmp_path, "kv_consumer", **kw)
    a = _request(A_REQ, [700 + i for i in range(A_LEN)], steps)
    d.add_request(a)
    reads = {}  # step -> {(block, offset)} its window reads for A (A's own block list, vLLM's window rule)
    processed, b_added = set(), False
    for _i, kind, out, step, queue in _engine_order(d, 6 * steps):
        if kind == "scheduled":
            if A_REQ in out.num_scheduled_tokens and A_REQ in d.requests:
                n, c = out.num_scheduled_tokens[A_REQ], a.num_computed_tokens  # (schedule() advanced it)
                ids = d.kv_cache_manager.get_block_ids(A_REQ)[0]
                first = max(c - n - SLIDING_WINDOW + 1, 0)  # the window of its first query position
                reads[step] = _slots(ids, range(first, c))
            if b_added and B_REQ in d.requests and d.kv_cache_manager.get_block_ids(B_REQ)[0]:
                b_ids = list(d.kv_cache_manager.get_block_ids(B_REQ)[0])
                loads = _slots(b_ids, range(B_LEN))  # what NIXL fills
                pending = sorted(s for _o, s in queue if s not in processed and s in reads and s != step)
                hit = sorted(loads & set().union(*(reads[s] for s in pending))) if pending else []
                assert not hit, (
                    f"{B_REQ} was handed blocks {b_ids} to load {B_LEN} prompt tokens from P while step(s) {pending} "
                    f"of {A_REQ}, still in flight (their outputs not processed), read (block, offset) {hit} in its "
                    f"{SLIDING_WINDOW}-token window: the block was pruned from {A_REQ} by the optimistic computed "
                    f"count; the NIXL read and that step's attention are unordered (vLLM #47282, fixed by PR #47728)")
                return
            if not b_added and A_REQ in d.requests and a.num_computed_tokens > A_LEN + BLOCK_SIZE \\
                    and (a.num_computed_tokens - SLIDING_WINDOW + 1) % BLOCK_SIZE == 0:
                # the next schedule() prunes a block this step (in flight then) still reads: B arrives now
                prompt = [1700 + i for i in range(B_LEN)]
                params = _prefill_on_p(p, P_REQ, prompt)
                d.add_request(_request(B_REQ, prompt, 8, dict(params)))
                b_added = True
            continue
        _feed(d, out, {A_REQ: 900 + step} if A_REQ in out.num_scheduled_tokens and A_REQ in d.requests else {})
        processed.add(step)
    pytest.fail(f"{B_REQ} was never allocated: the situation was not rebuilt")
'''

INFLIGHT_DOC = '''"""Regression test for the token of the step in flight at a KV-load rollback (kv-load-failure-recovery: in-flight token), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; async_scheduling={async_}; block size {bs}; D request {req}: a {prompt_len}-token prompt loaded
from P, max_tokens {max_tokens}; block index(es) {failed} (positions in its block list, from 0) reported failed (invalid_block_ids) in the
output of step {report_step}, while step {in_flight} was in flight (the newest step scheduled, which `pdtrace check`
names as the failure's step); kv_load_failure_policy "recompute".

Under async scheduling the engine core (EngineCore.step_with_batch_queue, a batch queue of two) schedules step n+1
before it processes step n's output. When step n's output reports a running request's blocks as failed, the
scheduler cuts the request back and recomputes; but step n+1 already ran on the failed KV, and when its output is
processed after the rollback its sampled token is appended to the request's output (nothing marks it stale): a token
of garbage KV reaches the user, silently. Open upstream in every release pdtrace installs (0.19.1-0.33.0); vLLM
0.32+ drops a preempted request's in-flight output (drop_stale_output) but not a rolled-back one's.

Runs with pytest and vLLM alone, on CPU: the real AsyncScheduler, KV cache manager and NixlConnector scheduler side of
P and D, the scheduler's own failure path and output processing. What is written by hand: the engine core's order
and the worker's ModelRunnerOutput (each step samples a distinct token id, so the test can tell which step's token
reached the output; the failed blocks in invalid_block_ids).
"""
'''

INFLIGHT_TEST = '''

def test_a_kv_load_rollback_keeps_no_token_of_the_step_in_flight(tmp_path):
    d, req = _loaded_on_d(tmp_path, P_REQ, D_REQ, PROMPT_LEN, MAX_TOKENS)
    sampled, in_flight, failed = {}, None, set()
    for i, kind, out, step, queue in _engine_order(d, STEPS + 3, first_step=FIRST_STEP):  # (steps as the trace's)
        if kind != "output":
            continue
        toks = {}
        if D_REQ in out.num_scheduled_tokens:
            toks = {D_REQ: 5000 + step}  # what the worker sampled for that step
            sampled[step] = 5000 + step
        kvo = {}
        if i == REPORT_AT:  # this output reports the failed blocks; the newer step is in flight
            blocks = list(d.kv_cache_manager.get_block_ids(D_REQ)[0])
            failed = {blocks[j] for j in FAILED_BLOCK_INDEXES if j < len(blocks)}
            kvo["invalid_block_ids"] = failed
            in_flight = queue[-1][1] if queue else None
        _feed(d, out, toks, force=True, **kvo)
    assert in_flight is not None, "no step was in flight at the rollback: the situation was not rebuilt"
    token = sampled.get(in_flight)
    out_ids = list(req.output_token_ids)
    assert token not in out_ids, (
        f"{D_REQ}'s block(s) {sorted(failed)} were reported failed while step {in_flight} was in flight; that step ran "
        f"on the failed KV, and its token {token} is in the output after the rollback: {out_ids} (position "
        f"{out_ids.index(token)}); nothing marked the in-flight output stale (kv-load-failure-recovery, vLLM #49250)")
'''

DRAFTER_GROUP_DOC = '''"""Regression test for the drafter's KV cache group left out of a P/D transfer (kv-never-crossed, vLLM #54926's shape), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; block size {bs}; async_scheduling={async_}; request {req}, a
prompt of {prompt_len} tokens that P ({p_req}) prefilled for D. D's KV cache groups:
{groups_words}

D, a NIXL kv_consumer, loads the prompt's KV from P before its first forward. Its scheduler counts the loaded tokens
computed for every KV cache group (get_num_new_matched_tokens, allocate_slots); the connector loads only into the
groups of KVCacheConfig.transfer_group_ids (the groups built with enable_kv_transfer). So every group a request's
computed positions sit in must be among the groups the connector loads into: a group left out holds blocks that no
transfer and no forward on D wrote, and the layers of that group attend to them. When it is the drafter's group
(is_eagle_group), the target's tokens stay right (it verifies every draft) while the drafter proposes from garbage
and acceptance falls (vLLM #54926: draft-model groups left out of NIXL's transfer groups, Gemma 4 with MTP). This
test builds D's groups as recorded, flags included, so it fails on every vLLM that honours the flag (0.30.0 on) and
counts the tokens computed anyway; before 0.30.0 KVCacheGroupSpec has no enable_kv_transfer, every group transfers,
and it skips.

Runs with pytest and vLLM alone, on CPU: the real Scheduler, KV cache manager and NixlConnector scheduler side of P
and D over the recorded groups, no model weights; the sampled tokens and the load's landing are fed back by hand.
"""
'''

DRAFTER_GROUP_TEST = '''

def test_d_loads_every_kv_cache_group_it_counts_computed(tmp_path):
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    if not all(g["transfer"] for g in GROUPS) and "enable_kv_transfer" not in {
            f.name for f in dataclasses.fields(KVCacheGroupSpec)}:
        pytest.skip("this vLLM has no KVCacheGroupSpec.enable_kv_transfer: every group transfers, so the recorded "
                    "layout (a group left out of the transfer) cannot be built")
    p = _scheduler(tmp_path, "kv_producer", kv_groups=GROUPS)
    d = _scheduler(tmp_path, "kv_consumer", kv_groups=GROUPS)
    prompt = _prompt(PROMPT_LEN)
    params = _prefill_on_p(p, P_REQ, prompt)
    req = _request(D_REQ, prompt, 4, dict(params))
    d.add_request(req)
    out, _ = _step(d)  # D allocates the blocks the load fills (WAITING_FOR_REMOTE_KVS)
    recv = getattr(out.kv_connector_metadata, "reqs_to_recv", None) or {}
    assert D_REQ in recv, "D's connector planned no load for the request: the situation was not rebuilt"
    into = [list(x) for x in recv[D_REQ].local_block_ids]
    if into and not isinstance(recv[D_REQ].local_block_ids[0], (list, tuple)):  # (one list before per-group lists)
        into = [list(recv[D_REQ].local_block_ids)]
    kvc = d.kv_cache_config
    transfer = list(getattr(kvc, "transfer_group_ids", range(len(kvc.kv_cache_groups))))
    loaded = {g: set(into[i]) for i, g in enumerate(transfer) if i < len(into)}
    _step(d, finished_recving={D_REQ})  # the load lands
    out = d.schedule()  # D takes the request up: its computed count is the load's, plus what it schedules now
    computed = req.num_computed_tokens - out.num_scheduled_tokens.get(D_REQ, 0)
    assert computed > 0, "D counted nothing computed after the load: the situation was not rebuilt"
    for g, ids in enumerate(d.kv_cache_manager.get_block_ids(D_REQ)):
        held = [b for b in list(ids)[:_cdiv(computed, BLOCK_SIZE)] if b]  # D's blocks of the computed positions
        missing = [b for b in held if b not in loaded.get(g, set())]
        who = "the drafter's group (is_eagle_group)" if GROUPS[g]["eagle"] else "a target group"
        assert not missing, (
            f"group {g}, {who}, layers {GROUPS[g]['layers']}: D counts {computed} of {D_REQ}'s {PROMPT_LEN} prompt "
            f"tokens computed after the load, for every group, but its block(s) {missing} holding positions "
            f"0..{computed - 1} in this group are not among the blocks the connector loads into ({into}, transfer "
            f"groups {transfer}): nothing wrote them, and the layers of this group attend to them (vLLM #54926)")
'''
