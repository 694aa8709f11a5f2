"""`pdtrace repro TRACE --cause N` (issue 61): the regression test a fix lands with, for one root cause of a trace.

The file it writes runs with pytest and vLLM alone (no pdtrace import), in the style of vLLM's
tests/v1/kv_connector/unit/, so it can be pasted into a vLLM pull request. It rebuilds the recorded situation on
the installed vLLM's own Scheduler, KV cache manager and NIXL connector (scheduler side, CPU) with the recorded
block size, speculative method and k, async setting and prompt length, and asserts on vLLM's objects what the
finding says was broken, never on pdtrace's verdict. It fails on the release whose bug the trace shows and passes
where that bug is fixed.

Rebuilt so far: lookahead-block-misalignment (vLLM #44151: P hands D its spec-decode lookahead blocks; fixed in
0.25.0). Every other cause gets one line saying so and exit 2. This module reads traces only; it never imports
vLLM.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from pdtrace.errors import PdtraceError

LOOKAHEAD = "lookahead-block-misalignment"
_CONFIGS = Path(__file__).resolve().parent.parent / "testing" / "configs"
_SPEC = {"eagle": "eagle", "eagle3": "eagle", "mtp": "eagle", "draft_model": "eagle", "ngram": "ngram", "": ""}

_TEMPLATE = '''"""Regression test for vLLM #44151's class (lookahead-block-misalignment), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; block size {bs}; async scheduling {async_}; a prompt of {prompt_len}
tokens (P request {p_req}).

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

import json

import pytest

pytest.importorskip("vllm")

PROMPT_LEN = {prompt_len}
BLOCK_SIZE = {bs}
SPEC_METHOD = {spec!r}  # recorded: {rec_method!r}
NUM_SPEC_TOKENS = {k}
ASYNC_SCHEDULING = {async_}
TARGET = {target}
DRAFT = {draft}


def _cdiv(a, b):
    return -(-a // b)


def _model_dir(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _scheduler(tmp_path):
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    target = _model_dir(tmp_path, "target", TARGET)
    mc = ModelConfig(model=target, tokenizer=target, skip_tokenizer_init=True, dtype="float32", seed=0,
                     max_model_len=2048)
    spec = None
    if SPEC_METHOD == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=NUM_SPEC_TOKENS, prompt_lookup_max=4,
                                 prompt_lookup_min=2)
    elif SPEC_METHOD:
        spec = SpeculativeConfig(method=SPEC_METHOD, model=_model_dir(tmp_path, "draft", DRAFT),
                                 num_speculative_tokens=NUM_SPEC_TOKENS, target_model_config=mc,
                                 target_parallel_config=ParallelConfig())
    extra = {{}}
    try:
        from vllm.config import AttentionConfig
        extra["attention_config"] = AttentionConfig()
    except ImportError:
        pass
    vc = VllmConfig(model_config=mc, speculative_config=spec,
                    scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048,
                                                     enable_chunked_prefill=True, is_encoder_decoder=False,
                                                     async_scheduling=ASYNC_SCHEDULING),
                    cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                    kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer",
                                                        engine_id="repro-P"),
                    device_config=DeviceConfig("cpu"), **extra)
    vc.scheduler_config.async_scheduling = ASYNC_SCHEDULING
    vc.cache_config.num_gpu_blocks = 256
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.self_attn.attn"],
        FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32))])
    if ASYNC_SCHEDULING:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as cls
    return cls(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
               block_size=BLOCK_SIZE, log_stats=False)


def _request(rid):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    sp.update_from_generation_config({{}}, 2)
    r = Request(request_id=rid, prompt_token_ids=[(7 * i) % 900 + 3 for i in range(PROMPT_LEN)], sampling_params=sp,
                pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    r.kv_transfer_params = {{"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                            "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    return r


def _prefill(sched, rid):
    """Schedule P's request and feed back one sampled token per finished prefill until vLLM's own
    _connector_finished / NixlConnector.request_finished return its kv_transfer_params."""
    from vllm.v1.outputs import ModelRunnerOutput

    sched.add_request(_request(rid))
    for _ in range(16):
        out = sched.schedule()
        req = sched.requests.get(rid)
        ids = [r for r in out.num_scheduled_tokens if r == rid]
        done = req is not None and req.num_computed_tokens >= req.num_prompt_tokens
        toks = [[100] if done or not ids else []]
        eco = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={{r: i for i, r in enumerate(ids)}}, sampled_token_ids=toks[:len(ids)]))
        for outs in eco.values():
            for o in outs.outputs:
                if o.request_id == rid and o.kv_transfer_params:
                    return dict(o.kv_transfer_params)
    raise AssertionError("P never finished the prefill with kv_transfer_params")


def test_p_hands_d_only_the_blocks_holding_its_computed_tokens(tmp_path):
    sched = _scheduler(tmp_path)
    params = _prefill(sched, "p-req")
    table = [list(g) for g in sched.kv_cache_manager.get_block_ids("p-req")]  # P's own block table, held for D
    reported = params["remote_block_ids"]
    if reported and not isinstance(reported[0], (list, tuple)):  # (releases before per-group lists: one list)
        reported = [reported]
    n = _cdiv(params.get("remote_num_tokens") or PROMPT_LEN, BLOCK_SIZE)
    for g, ids in enumerate(reported):
        want = table[g][:n]
        extra = [b for b in ids if b not in want]
        assert list(ids) == want, (
            f"group {{g}}: P handed D blocks {{list(ids)}} for {{PROMPT_LEN}} computed tokens; the blocks holding them "
            f"in P's block table are {{want}} (block size {{BLOCK_SIZE}}). Block(s) {{extra}} are {{SPEC_METHOD}} "
            f"lookahead slots past the prompt: D keeps remote[-{{n}}:] and reads P's block i+1 into its block i "
            f"(vLLM #44151)")
'''


def render(s: dict[str, Any], trace: str, cause: Any, vllm: str) -> str:
    """The standalone test for ``s`` (``repro.situation``) of root cause ``cause`` (a ``causes.Cause``)."""
    spec = _SPEC.get(s["spec_method"])
    if spec is None:
        raise PdtraceError(f"{trace}: cause {cause.n} was recorded with speculative method {s['spec_method']!r}, "
                           f"which repro cannot rebuild yet (eagle-like methods and ngram); attach the trace instead")
    if len(s["block_sizes"]) > 1 or s["hybrid"]:
        raise PdtraceError(f"{trace}: cause {cause.n} was recorded with {len(s['block_sizes'])} KV cache groups "
                           f"({', '.join(s['group_kinds'])}); repro rebuilds one full-attention group so far")
    k = s["num_spec_tokens"] if spec else 0
    words = f"{s['spec_method']} with {k} speculative tokens" if spec else "no speculative decoding"
    return _TEMPLATE.format(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), trace=trace,
        n=cause.n, title=cause.title, vllm=vllm or "?", method_words=words, bs=s["block_sizes"][0],
        async_=s["async_scheduling"], prompt_len=s["prompt_len"], p_req=s["p_req"], spec=spec,
        rec_method=s["spec_method"], k=k, target=_config("tiny-llama"), draft=_config("tiny-eagle"))


def _config(name: str) -> str:
    """A tiny HF config as a Python literal (the test writes it as config.json)."""
    return repr(json.loads((_CONFIGS / name / "config.json").read_text()))


def run(trace: Any, n: int, output: Any, lenient: bool = False) -> int:
    from pdtrace.detectors import by_severity, run_all
    from pdtrace.detectors.causes import group
    from pdtrace.tracefile.trace import load

    t = load(str(trace), lenient=lenient)
    causes = group(by_severity(run_all(t.events, t.header)))
    if not causes:
        raise PdtraceError(f"{trace}: no root cause (check finds nothing): there is no failing test to write")
    if not 1 <= n <= len(causes):
        raise PdtraceError(f"{trace}: --cause {n}: the trace has {len(causes)} root cause(s), 1-{len(causes)} "
                           f"(pdtrace check {trace} lists them)")
    c = causes[n - 1]
    text = for_cause(t.events, t.header, c, str(trace))
    out = Path(output)
    out.write_text(text)
    print(f"wrote {out}: cause {n} ({c.kind}), request {c.first.get('req')}: a standalone vLLM test (pytest and "
          f"vLLM only); it fails on the release whose bug this is and passes where it is fixed")
    return 0


def for_cause(events: list, header: dict, c: Any, trace: str) -> str:
    """The standalone test of root cause ``c``; PdtraceError (one line) where it cannot be rebuilt."""
    from pdtrace.commands.repro_situation import situation
    from pdtrace.detectors.causes import header_vllm

    if c.kind != LOOKAHEAD:
        raise PdtraceError(f"{trace}: cause {c.n} ({c.kind}: {c.mechanism}) cannot be rebuilt yet: repro writes a "
                           f"standalone vLLM test for {LOOKAHEAD} (vLLM #44151) only; attach the trace (pdtrace "
                           f"bundle) and see `pdtrace check {trace} --cause {c.n}`")
    return render(situation(events, str(c.first.get("req"))), trace, c, header_vllm(header))
