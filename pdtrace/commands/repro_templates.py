"""The text of the tests `pdtrace repro --cause N` writes (issue 61): plain Python, no pdtrace import.

A written file is: a docstring (the class's, filled from the trace), the imports, the recorded constants (written by
``repro_standalone``), ``HELPERS`` (building the installed vLLM's own Scheduler / AsyncScheduler with the NIXL
connector's scheduler side from a tiny config written to tmp, real Requests, one step with the sampled tokens fed
back through a real ModelRunnerOutput) and the class's test. The helpers are the harness's (pdtrace/testing/
pd_harness.py, pd_steps.py), written out so that the file runs with pytest and vLLM alone, on CPU, and builds on every
release pdtrace's matrix installs (0.19.1 onward). This module holds text only; it never imports vLLM.
"""

from __future__ import annotations

PREAMBLE = '''
import json

import pytest

pytest.importorskip("vllm")

'''

# the two helpers every written file has (``HELPERS`` starts with them; the metadata test has them alone)
BASIC = '''

def _cdiv(a, b):
    return -(-a // b)


def _model_dir(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)
'''

HELPERS = BASIC + '''

def _scheduler(tmp_path, role, policy=None, long_prefill=0, max_num_batched_tokens=1024, num_blocks=256,
               max_model_len=2048, max_num_seqs=8, kv_groups=None, extra_config=None):
    """vLLM's own Scheduler (AsyncScheduler when the trace's was async), kv_role ``role``, the NIXL connector's
    scheduler side, one KV cache group of the recorded block size (full attention, or a sliding window of
    SLIDING_WINDOW tokens), or ``kv_groups`` (each group's layers, its sliding window or chunk (chunked-local
    attention) or neither for full attention, whether vLLM marks it the drafter's, whether it transfers);
    ``extra_config``: the connector's kv_connector_extra_config; no model weights."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    target = _model_dir(tmp_path, "target", TARGET)
    mc = ModelConfig(model=target, tokenizer=target, skip_tokenizer_init=True, dtype="float32", seed=0,
                     max_model_len=max_model_len)
    spec = None
    if SPEC_METHOD == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=NUM_SPEC_TOKENS, prompt_lookup_max=4,
                                 prompt_lookup_min=2)
    elif SPEC_METHOD == "draft_model":  # (a draft model: the target's own tiny config stands for it)
        spec = SpeculativeConfig(method="draft_model", model=target, num_speculative_tokens=NUM_SPEC_TOKENS,
                                 target_model_config=mc, target_parallel_config=ParallelConfig())
    elif SPEC_METHOD:
        spec = SpeculativeConfig(method=SPEC_METHOD, model=_model_dir(tmp_path, "draft", DRAFT),
                                 num_speculative_tokens=NUM_SPEC_TOKENS, target_model_config=mc,
                                 target_parallel_config=ParallelConfig())
    extra = {}
    try:
        from vllm.config import AttentionConfig
        extra["attention_config"] = AttentionConfig()
    except ImportError:
        pass
    sched_kw = {"long_prefill_token_threshold": long_prefill} if long_prefill else {}
    kvt_kw = {"kv_load_failure_policy": policy} if policy else {}
    if extra_config:
        kvt_kw["kv_connector_extra_config"] = dict(extra_config)
    vc = VllmConfig(model_config=mc, speculative_config=spec,
                    scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                     max_num_batched_tokens=max_num_batched_tokens,
                                                     max_model_len=max_model_len, enable_chunked_prefill=True,
                                                     is_encoder_decoder=False, async_scheduling=ASYNC_SCHEDULING,
                                                     **sched_kw),
                    cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                    kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                                                        engine_id="repro-" + role, **kvt_kw),
                    device_config=DeviceConfig("cpu"), **extra)
    vc.scheduler_config.async_scheduling = ASYNC_SCHEDULING  # (the CPU platform may turn it off)
    vc.cache_config.num_gpu_blocks = num_blocks
    common = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32)
    spec_ = SlidingWindowSpec(**common, sliding_window=SLIDING_WINDOW) if SLIDING_WINDOW else FullAttentionSpec(**common)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec_)]
    if kv_groups:
        import dataclasses

        has = {f.name for f in dataclasses.fields(KVCacheGroupSpec)}  # (the flags, where this vLLM has them)
        def kind(g):
            if g.get("chunk"):
                from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

                return ChunkedLocalAttentionSpec(**common, attention_chunk_size=g["chunk"])
            if g.get("window"):
                return SlidingWindowSpec(**common, sliding_window=g["window"])
            return FullAttentionSpec(**common)

        groups = [KVCacheGroupSpec(list(g["layers"]), kind(g), **{
            k: v for k, v in (("is_eagle_group", g["eagle"]), ("enable_kv_transfer", g["transfer"])) if k in has})
            for g in kv_groups]
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    if ASYNC_SCHEDULING:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as cls
    return cls(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
               block_size=BLOCK_SIZE, log_stats=False)


def _prompt(n, seed=0):
    return [(7 * i + 31 * seed) % 900 + 3 for i in range(n)]


def _request(rid, prompt, max_tokens=1, kv=None, stop_token_ids=None):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    if stop_token_ids:  # (a stop token ends it, as an EOS does: a finish no scheduler sees coming)
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids))
    else:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                mm_features=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    r.kv_transfer_params = kv
    return r


def _step(sched, tokens=None, **kvo):
    """One scheduler step: schedule(), then update_from_output() with what the worker would return: ``tokens``
    (request -> sampled token) for each scheduled request past its prompt (a partial prefill chunk samples
    nothing), and ``kvo`` as the KVConnectorOutput (finished_recving, invalid_block_ids, ...). Returns
    (scheduler output, engine-core outputs)."""
    out = sched.schedule()
    return out, _feed(sched, out, tokens, **kvo)


def _feed(sched, out, tokens=None, force=False, **kvo):
    """update_from_output() for the scheduler output ``out`` (``_step``'s second half; under async scheduling the
    engine core feeds a step's output after it scheduled the next step). ``force``: every request in ``tokens``
    gets its token, as the worker sampled it, even where the scheduler has since cut the request back."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests.get(rid)
        if req is None or rid not in (tokens or {}):
            continue
        ids.append(rid)
        done = req.num_computed_tokens >= req.num_prompt_tokens  # (schedule() counted this step's tokens)
        sampled.append([tokens[rid]] if done or force else [])
    kv_out = None
    if kvo:
        kv_out = KVConnectorOutput(finished_sending=kvo.get("finished_sending"),
                                   finished_recving=kvo.get("finished_recving"))
        if kvo.get("invalid_block_ids"):
            kv_out.invalid_block_ids = set(kvo["invalid_block_ids"])
    return sched.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
        kv_connector_output=kv_out))


def _prefill_on_p(sched, rid, prompt):
    """P's side of a disaggregated request (do_remote_decode): schedule and feed one sampled token until vLLM's
    own _connector_finished / NixlConnector.request_finished return its kv_transfer_params."""
    sched.add_request(_request(rid, prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                                "remote_engine_id": None, "remote_block_ids": None,
                                                "remote_host": None, "remote_port": None}))
    for _ in range(16):
        _out, eco = _step(sched, {rid: 100})
        for outs in eco.values():
            for o in outs.outputs:
                if o.request_id == rid and o.kv_transfer_params:
                    return dict(o.kv_transfer_params)
    raise AssertionError("P never finished the prefill with kv_transfer_params")


def _slots(ids, positions):
    """The (block, offset) pairs that hold ``positions`` in the block list ``ids`` (vLLM's own list, in token order),
    positions past the list and the null block (id 0: pruned from a sliding window) left out."""
    return {(ids[q // BLOCK_SIZE], q % BLOCK_SIZE) for q in positions
            if q // BLOCK_SIZE < len(ids) and ids[q // BLOCK_SIZE]}


def _engine_order(sched, iterations, first_step=1):
    """EngineCore.step_with_batch_queue's order under async scheduling (a batch queue of two): each iteration
    schedules a step while the scheduler has requests, then hands back the oldest scheduled step's output once two
    are queued (or once nothing more is scheduled). Yields (iteration, "scheduled" or "output", the scheduler output,
    its step, the queue of (output, step) newest first, the yielded output already popped); the caller feeds each
    "output" (``_feed``). Steps are numbered from ``first_step``."""
    import collections

    queue = collections.deque()
    step = first_step - 1
    for i in range(iterations):
        if sched.has_requests():
            out = sched.schedule()
            step += 1
            queue.appendleft((out, step))
            yield i, "scheduled", out, step, queue
            if len(queue) < 2:
                continue
        if not queue:
            return
        old, s = queue.pop()
        yield i, "output", old, s, queue


def _loaded_on_d(tmp_path, p_req, d_req, prompt_len, max_tokens):
    """P prefills a prompt for a remote decode; D (kv_consumer, kv_load_failure_policy "recompute") allocates the
    blocks the load fills and the load lands. Returns (D's scheduler, D's request)."""
    p = _scheduler(tmp_path, "kv_producer")
    d = _scheduler(tmp_path, "kv_consumer", policy="recompute")
    prompt = _prompt(prompt_len)
    params = _prefill_on_p(p, p_req, prompt)
    req = _request(d_req, prompt, max_tokens, dict(params))
    d.add_request(req)
    _step(d)  # D allocates the blocks the load fills (WAITING_FOR_REMOTE_KVS)
    _step(d, finished_recving={d_req})  # the load lands
    return d, req
'''

LOOKAHEAD_DOC = '''"""Regression test for vLLM #44151's class (lookahead-block-misalignment), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; block size {bs}; async_scheduling={async_}; a prompt of {prompt_len}
tokens (P request {p_req}){groups_words}.

P, a NIXL kv_producer, prefills one prompt for a remote decode. The block ids it hands D
(kv_transfer_params["remote_block_ids"]) must be exactly the blocks of P's own block table that hold the prompt's
computed tokens. A P that hands D its speculative-decoding lookahead blocks too makes D's NIXL worker, which keeps
remote[-n:] of that list, read P's block i+1 into its block i: the KV of another position
(https://github.com/vllm-project/vllm/issues/44151; fixed in 0.25.0, where P reports
get_block_ids_for_computed_tokens). Which earlier releases fail depends on the situation: for a 16-token prompt,
EAGLE and blocks of 16, 0.23.0 and 0.24.0 do and 0.19.1-0.22.1 do not (they reserve no lookahead block there).

Runs with pytest and vLLM alone, on CPU: the real Scheduler, KV cache manager and NixlConnector scheduler side, no
model weights (a tiny config written to a temporary directory; the sampled tokens are fed back by hand).
"""
'''

LOOKAHEAD_TEST = '''

def test_p_hands_d_only_the_blocks_holding_its_computed_tokens(tmp_path):
    sched = _scheduler(tmp_path, "kv_producer", kv_groups=GROUPS)
    params = _prefill_on_p(sched, "p-req", _prompt(PROMPT_LEN))
    table = [list(g) for g in sched.kv_cache_manager.get_block_ids("p-req")]  # P's own block table, held for D
    reported = params["remote_block_ids"]
    if reported and not isinstance(reported[0], (list, tuple)):  # (releases before per-group lists: one list)
        reported = [reported]
    n = _cdiv(params.get("remote_num_tokens") or PROMPT_LEN, BLOCK_SIZE)
    for g, ids in enumerate(reported):
        want = table[g][:n]
        if GROUPS and GROUPS[g].get("window"):  # (a sliding window: P hands D the blocks still in it, the tail)
            want = [b for b in want if b][-len(ids):] if ids else []
        extra = [b for b in ids if b not in table[g][:n]]
        assert list(ids) == want, (
            f"group {g}: P handed D blocks {list(ids)} for {PROMPT_LEN} computed tokens; the blocks holding them "
            f"in P's block table are {want} (block size {BLOCK_SIZE}). Block(s) {extra} are {SPEC_METHOD} "
            f"lookahead slots past the prompt: D keeps remote[-{n}:] and reads P's block i+1 into its block i "
            f"(vLLM #44151)")
'''

DFLASH_DOC = '''"""Regression test for vLLM's DFlash lookahead (drafter-window-outside-allocation), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; block size {bs}; async_scheduling={async_}; a prompt of {prompt_len}
tokens (request {req}, on {inst}: {role}).

After the target model prefills the prompt, the DFlash drafter writes KV at 1 + k query positions from the prompt's
end, into the request's own block table (vllm/v1/spec_decode/dflash.py: num_query_per_req = 1 +
num_speculative_tokens). The scheduler allocates the slots of a step in that step's allocate_slots, lookahead
included, so the blocks it gives the request at its first schedule must hold prompt + k + 1 slots: a slot past
them is a block that is not the request's (another request's KV, or the null block). Releases 0.20.0-0.22.1 reserve
k slots for DFlash and none at a request's first schedule (seed 003 of pdtrace's seeds); 0.23.0 reserves k + 1
(vllm_config.num_lookahead_tokens, tests/v1/spec_decode/test_dflash_lookahead.py).

Runs with pytest and vLLM alone, on CPU: the real Scheduler and KV cache manager (and the NixlConnector scheduler side
of the recorded role), no model weights (a tiny DFlash draft config written to a temporary directory).
"""
'''

DFLASH_TEST = '''

def test_the_dflash_drafter_writes_inside_the_blocks_the_scheduler_gave_the_request(tmp_path):
    try:
        sched = _scheduler(tmp_path, KV_ROLE)
    except Exception as exc:  # (pydantic's literal error: SpeculativeConfig.method has no 'dflash' before 0.20.0)
        if "'dflash'" in str(exc) and "method" in str(exc):
            pytest.skip("this vLLM has no DFlash (SpeculativeConfig.method rejects 'dflash'): nothing to test")
        raise
    kv = None
    if KV_ROLE == "kv_producer":
        kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    sched.add_request(_request("r", _prompt(PROMPT_LEN), 1, kv))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("r") == PROMPT_LEN, "the prompt was not prefilled in one step"
    blocks = list(sched.kv_cache_manager.get_block_ids("r")[0])
    end = PROMPT_LEN + NUM_SPEC_TOKENS + 1  # the drafter's window: [PROMPT_LEN, PROMPT_LEN + k + 1)
    held = len(blocks) * BLOCK_SIZE
    assert end <= held, (
        f"the DFlash drafter (k={NUM_SPEC_TOKENS}) writes positions {PROMPT_LEN}..{end - 1} after a "
        f"{PROMPT_LEN}-token prefill, but the scheduler gave the request blocks {blocks}: {held} slots (block size "
        f"{BLOCK_SIZE}); position(s) {held}..{end - 1} land past them, in a block that is not the request's. The "
        f"scheduler reserved {getattr(sched, 'num_lookahead_tokens', '?')} lookahead slot(s); DFlash needs k + 1 = "
        f"{NUM_SPEC_TOKENS + 1} from the first schedule (vLLM 0.23.0's fix, seed 003)")
'''
