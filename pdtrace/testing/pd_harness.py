"""A P/D + speculative-decoding harness on REAL vLLM scheduler code, on CPU (0.32.0 in the main
venv; 0.22.1-0.33.0 each in its own venv, ``pdtrace.testing.real_release``).

What is real: ``vllm.v1.core.sched.scheduler.Scheduler`` (or ``AsyncScheduler``) for a
prefill instance (kv_role ``kv_producer``) and a decode instance (``kv_consumer``), each
with the real ``NixlConnector`` scheduler side, real ``KVCacheManager``, real speculative
configs (EAGLE / DFlash from tiny local draft config dirs under ``configs/``; ngram), and
the real ``_apply_prefix_caching`` of ``NixlBaseConnectorWorker``. The pdtrace hooks are
installed, and an in-memory ``Recorder`` collects the events they emit.

What is simulated (and marked ``sim: true`` in the trace): the GPU worker. Sampled tokens
are fed back through a real ``ModelRunnerOutput``; the NIXL READ itself (``nixl.read`` /
``nixl.read_done``, ``nixl.send_done`` on P) is emitted by the harness for the block
pairs the real ``_apply_prefix_caching`` produced, because a real read needs registered
KV caches on a worker.

The worker used for ``_apply_prefix_caching`` is built with ``object.__new__`` (no
``__init__``: that needs a device, a NIXL agent and registered caches) and given only the
attributes that method reads: ``_has_mamba`` and, for hybrid models, ``_group_spec_types``.

Fault injection (test fixtures, never production): ``old_p_block_rule`` and
``old_dflash_lookahead`` re-introduce old vLLM rules on the real code path and emit a
``fault.inject`` event, so clean and buggy traces can be produced side by side.

Public API (see ``run_pd_request``): ``PDConfig``, ``build_vllm_config``,
``build_kv_cache_config``, ``build_scheduler``, ``PDPair``, ``make_pair``,
``run_pd_request`` -> ``PDResult``, ``old_p_block_rule``, ``old_dflash_lookahead``,
``FAULTS``, ``new_recorder``, ``write_scenario_trace``. The faults live in ``pd_faults``, the
stepping in ``pd_steps``, D's NIXL worker side in ``pd_nixl``; all importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from typing import Any, Iterator

from pdtrace.record import recorder as _recorder
from pdtrace.record.recorder import Recorder

from .pd_faults import FAULTS, old_dflash_lookahead, old_p_block_rule  # noqa: F401 - part of this module's API
from .pd_nixl import (  # noqa: F401 - part of this module's API
    _inline_read, _inline_worker_cls, _pull_worker_cls, _trim, _worker_for_trim, has_inline_trim, has_trim_method,
)
from .pd_steps import _kv_params_from, _make_request, _mro, _step, _tokens_for, drive, p_prefill  # noqa: F401

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
TARGET_DIR = os.path.join(CONFIG_DIR, "tiny-llama")
DRAFT_DIRS = {"eagle": os.path.join(CONFIG_DIR, "tiny-eagle"), "dflash": os.path.join(CONFIG_DIR, "tiny-dflash")}
SPEC_METHODS = ("", "ngram", "eagle", "dflash")

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclasses.dataclass(frozen=True)
class PDConfig:
    """One P/D setup. Hashable: configs are built once per distinct value and cached.

    spec_method: "" (none), "ngram" (lookahead 0), "eagle" (lookahead k), "dflash" (k+1).
    num_spec_tokens: k. block_size: attention block size (tokens).
    hybrid: add a Mamba (state) KV cache group after the attention group; mamba_block_size
    is that group's block size (defaults to block_size).
    async_scheduling: use vLLM's AsyncScheduler.
    attn: the attention KV cache groups, in order: "full" (FullAttentionSpec), "sliding"
    (SlidingWindowSpec, ``window`` tokens), "chunked" (ChunkedLocalAttentionSpec, chunks of
    ``window`` tokens); one layer each. engine_tag: appended to the instance in the engine id,
    so that two equal configs build two engines (2P2D).
    """

    spec_method: str = "eagle"
    num_spec_tokens: int = 3
    block_size: int = 16
    hybrid: bool = False
    mamba_block_size: int | None = None
    async_scheduling: bool = False
    num_blocks: int = 1024
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    attn: tuple[str, ...] = ("full",)
    window: int = 32
    engine_tag: str = ""  # makes the engine ids differ between otherwise equal instances (xPyD)
    kv_load_failure_policy: str = "fail"  # KVTransferConfig's: "fail" (vLLM's default) or "recompute"
    long_prefill: int = 0  # SchedulerConfig.long_prefill_token_threshold (0: vLLM's default)
    # a KV cache group of its own for the drafter's layer (KVCacheGroupSpec.is_eagle_group, as vLLM marks an MTP /
    # draft model's group): "transfer" (vLLM's default enable_kv_transfer) or "kept" (enable_kv_transfer=False: a
    # LABELLED FAULT, vLLM #54926's shape; 0.32 / 0.33 turn the flag off only for HiSparse groups)
    draft_group: str = ""

    def label(self) -> str:
        spec = f"{self.spec_method}k{self.num_spec_tokens}" if self.spec_method else "nospec"
        attn = "" if self.attn == ("full",) else "-" + "+".join(self.attn) + f"{self.window}"
        return (f"{spec}-bs{self.block_size}" + attn + ("-hybrid" if self.hybrid else "")
                + ("-async" if self.async_scheduling else "")
                + ("" if self.kv_load_failure_policy == "fail" else f"-{self.kv_load_failure_policy}")
                + (f"-chunk{self.long_prefill}" if self.long_prefill else "")
                + (f"-draft{self.draft_group}" if self.draft_group else ""))


ROLE_KV = {"P": "kv_producer", "D": "kv_consumer", "PD": "kv_both"}


@functools.lru_cache(maxsize=None)
def _model_config(max_model_len: int) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=TARGET_DIR, tokenizer=TARGET_DIR, skip_tokenizer_init=True,
                       dtype="float32", seed=0, max_model_len=max_model_len)


@functools.lru_cache(maxsize=None)
def build_vllm_config(inst: str, cfg: PDConfig) -> Any:
    """A real VllmConfig for instance ``inst`` ("P" | "D" | "PD") with the NIXL connector."""
    from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)

    mc = _model_config(cfg.max_model_len)
    spec = None
    if cfg.spec_method == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=cfg.num_spec_tokens,
                                 prompt_lookup_max=4, prompt_lookup_min=2)
    elif cfg.spec_method in DRAFT_DIRS:
        spec = SpeculativeConfig(method=cfg.spec_method, model=DRAFT_DIRS[cfg.spec_method],
                                 num_speculative_tokens=cfg.num_spec_tokens, target_model_config=mc,
                                 target_parallel_config=ParallelConfig())
    elif cfg.spec_method:
        raise ValueError(f"unknown spec_method {cfg.spec_method!r}; one of {SPEC_METHODS}")
    sc = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                         max_model_len=cfg.max_model_len, enable_chunked_prefill=True,
                         is_encoder_decoder=False, async_scheduling=cfg.async_scheduling,
                         **({"long_prefill_token_threshold": cfg.long_prefill} if cfg.long_prefill else {}))
    cc = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=True)
    policy = {} if cfg.kv_load_failure_policy == "fail" else {"kv_load_failure_policy": cfg.kv_load_failure_policy}
    kvt = KVTransferConfig(kv_connector="NixlConnector", kv_role=ROLE_KV[inst],
                           engine_id=f"pdtrace-{inst}{cfg.engine_tag}-{cfg.label()}", **policy)
    vc = VllmConfig(model_config=mc, speculative_config=spec, scheduler_config=sc, cache_config=cc,
                    kv_transfer_config=kvt, device_config=DeviceConfig("cpu"), attention_config=AttentionConfig())
    # VllmConfig's CPU platform checks may turn async scheduling off; the harness asks for what it was told.
    vc.scheduler_config.async_scheduling = cfg.async_scheduling
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    return vc


def build_kv_cache_config(cfg: PDConfig) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)

    common = {"block_size": cfg.block_size, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    groups = []
    for i, kind in enumerate(cfg.attn):
        if kind == "full":
            spec = FullAttentionSpec(**common)
        elif kind == "sliding":
            spec = SlidingWindowSpec(**common, sliding_window=cfg.window)
        elif kind == "chunked":
            spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=cfg.window)
        else:
            raise ValueError(f"unknown attention kind {kind!r}: full, sliding or chunked")
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec))
    if cfg.hybrid:
        # vLLM's MambaModelConfig.verify_and_update_config (0.32.0 and 0.33.0) sets
        # mamba_cache_mode="align" whenever prefix caching is on, as it is here; 0.33.0's
        # MambaManager asserts it.
        groups.append(KVCacheGroupSpec([f"model.layers.{len(groups)}.mixer"],
                                       MambaSpec(block_size=cfg.mamba_block_size or cfg.block_size,
                                                 shapes=((4, 8),), dtypes=(torch.float32,),
                                                 mamba_cache_mode="align")))
    if cfg.draft_group:
        if cfg.draft_group not in ("transfer", "kept"):
            raise ValueError(f"draft_group {cfg.draft_group!r}: '', 'transfer' or 'kept'")
        groups.append(KVCacheGroupSpec(["draft_model.layers.0.self_attn.attn"], FullAttentionSpec(**common),
                                       is_eagle_group=True, enable_kv_transfer=cfg.draft_group == "transfer"))
    return KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def build_scheduler(inst: str, cfg: PDConfig) -> Any:
    """A fresh real Scheduler (AsyncScheduler when cfg.async_scheduling) for instance ``inst``."""
    from vllm.v1.structured_output import StructuredOutputManager

    if cfg.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as cls
    vc = build_vllm_config(inst, cfg)
    return cls(vllm_config=vc, kv_cache_config=build_kv_cache_config(cfg),
               structured_output_manager=StructuredOutputManager(vc), block_size=cfg.block_size, log_stats=False)


@dataclasses.dataclass
class PDPair:
    cfg: PDConfig
    p: Any  # Scheduler, kv_producer
    d: Any  # Scheduler, kv_consumer
    rec: Recorder
    setup_events: list[dict] = dataclasses.field(default_factory=list)  # sched.config etc. from construction


def new_recorder(redact: bool = True) -> Recorder:
    return Recorder.in_memory(role="engine-core", redact=redact)


def install_scheduler_hooks() -> dict[str, str]:
    """Apply the scheduler-side hooks (subsystems 'scheduler', 'nixl' and 'kv_load') now;
    {hook: status}.

    Only these: the other worker-side subsystems target the GPU model runner, which the
    harness does not run (importing it is slow and pointless here).
    """
    import importlib

    from pdtrace import hooks

    importlib.import_module("pdtrace.hooks.scheduler")
    importlib.import_module("pdtrace.hooks.nixl")
    importlib.import_module("pdtrace.hooks.kv_load")
    out = {}
    for spec in list(hooks.REGISTRY.values()):
        if spec.subsystem not in ("scheduler", "nixl", "kv_load"):
            continue
        if spec.status != "applied":
            _st, reason, form = hooks.check_form(spec)  # this release's layout of the target
            if form is None:
                spec.status, spec.reason = "skipped", reason
            else:
                hooks._apply(spec, importlib.import_module(form[0]), form)
        out[spec.name] = spec.status
    return out


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    """Make ``rec`` the process recorder (hooks installed) for the duration."""
    install_scheduler_hooks()
    prev = _recorder.set_current(rec)
    try:
        yield rec
    finally:
        _recorder.set_current(prev)


def make_pair(cfg: PDConfig = PDConfig(), rec: Recorder | None = None) -> PDPair:
    """Build a P scheduler and a D scheduler (hooks on, ``rec`` current while building)."""
    rec = rec or new_recorder()
    rec.flush()
    start = len(rec.events or [])
    with recording(rec):
        p = build_scheduler("P", cfg)
        d = build_scheduler("D", cfg)
        from pdtrace import hooks

        hooks._report_status()  # what is applied, in this pair's events (as a recorded process says it)
    rec.flush()
    setup = [e for e in (rec.events or [])[start:]
             if e["ev"] in ("sched.config", "proc.role", "hooks.status", "hook.error")]
    return PDPair(cfg, p, d, rec, setup)


# ---------------------------------------------------------------------------------------
# one P/D request, end to end
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class PDResult:
    events: list[dict]  # the pair's setup events (sched.config of P and D, ...) + this run's events
    p_req: str
    d_req: str
    prompt_len: int
    p_params: dict  # kv_transfer_params P returned (what D receives)
    p_allocated: list[list[int]]  # blocks P held at finish, per group
    p_reported: list[list[int]]  # remote_block_ids P reported, per group
    d_local: list[list[int]]  # blocks D allocated for the load (connector's local_block_ids), per group
    trim_local: list[list[int]]  # _apply_prefix_caching output: D blocks
    trim_remote: list[list[int]]  # _apply_prefix_caching output: P blocks (trim_local[g][i] <- trim_remote[g][i])
    d_first_alloc: dict | None  # sched.alloc event of D's first run step after the load
    faults: tuple[str, ...]
    # read from vLLM's own KV cache managers, not from any hook (oracles): P's blocks when it
    # finished (per group, in token order), D's blocks for the request after its allocation
    p_blocks: list[list[int]] = dataclasses.field(default_factory=list)
    d_blocks: list[list[int]] = dataclasses.field(default_factory=list)

    def of(self, kind: str, inst: str | None = None) -> list[dict]:
        return [e for e in self.events if e["ev"] == kind and (inst is None or e.get("inst") == inst)]


_ids = itertools.count(1)


def run_pd_request(
    cfg: PDConfig = PDConfig(),
    prompt_len: int = 16,
    *,
    faults: tuple[str, ...] | list[str] = (),
    dflash_variant: str = "k",
    decode_steps: int = 3,
    pair: PDPair | None = None,
    rec: Recorder | None = None,
    req_ids: tuple[str, str] | None = None,
) -> PDResult:
    """Run one disaggregated request through real P and D schedulers.

    1. P: add (do_remote_decode), schedule, feed a ModelRunnerOutput with one sampled token
       (max_tokens=1), so P's real ``_connector_finished`` -> ``request_finished`` produce
       kv_transfer_params (``old_p_block_rule`` patches P here).
    2. D: add with those params (do_remote_prefill), schedule (real
       ``get_num_new_matched_tokens`` / ``allocate_slots`` / ``update_state_after_alloc``).
    3. The real ``_apply_prefix_caching`` on D's local and P's remote block ids (nixl.trim).
    4. Simulated nixl.read / nixl.read_done (sim=True) for the resulting pairs, then
       finished_recving to D and ``decode_steps`` decode steps with spec tokens; P gets
       finished_sending (simulated nixl.send_done) and frees its blocks.

    ``faults``: names from FAULTS. ``old_dflash_lookahead`` applies to both schedulers
    (``dflash_variant`` "k" or "zero"). ``pair``: reuse schedulers (and their recorder);
    otherwise a fresh pair is built. ``req_ids``: (P's, D's) request ids instead of fresh
    ones (to reuse ids across schedulers). Returns a PDResult with only this run's events.
    """
    for f in faults:
        if f not in FAULTS:
            raise ValueError(f"unknown fault {f!r}; one of {FAULTS}")
    if pair is None:
        pair = make_pair(cfg, rec)
    cfg, rec = pair.cfg, pair.rec
    n = next(_ids)
    p_req, d_req = req_ids or (f"req-{n}-P", f"req-{n}-D")
    base = 10 + (n * 97) % 500  # distinct prompts per run: no accidental prefix-cache hits
    prompt = [base + i for i in range(prompt_len)]
    rec.flush()
    start = len(rec.events or [])
    with contextlib.ExitStack() as stack:
        stack.enter_context(recording(rec))
        rec.emit("mark", label="scenario", sim=True,
                 detail=f"run_pd_request {cfg.label()} prompt_len={prompt_len} faults={list(faults)}")
        if "old_p_block_rule" in faults:
            stack.enter_context(old_p_block_rule(pair.p, rec))
        if "old_dflash_lookahead" in faults:
            stack.enter_context(old_dflash_lookahead(pair.p, rec, dflash_variant))
            stack.enter_context(old_dflash_lookahead(pair.d, rec, dflash_variant))

        # --- P: prefill, one token, finish -> kv_transfer_params
        params = p_prefill(pair.p, p_req, prompt, cfg.block_size)
        p_blocks = [list(g) for g in pair.p.kv_cache_manager.get_block_ids(p_req)]  # held until send_done

        # --- D: add with P's params, schedule: remote alloc
        dr = _make_request(d_req, prompt, max(decode_steps + 1, 2), dict(params), cfg.block_size)
        pair.d.add_request(dr)
        out_d = pair.d.schedule()
        meta = out_d.kv_connector_metadata
        rmeta = getattr(meta, "reqs_to_recv", {}).get(d_req)
        pair.d.update_from_output(out_d, _mro(out_d, {}))
        d_blocks = [list(g) for g in pair.d.kv_cache_manager.get_block_ids(d_req)]
        d_local = [list(g) for g in rmeta.local_block_ids] if rmeta is not None else []
        remote = [list(g) for g in rmeta.remote.block_ids] if rmeta is not None and rmeta.remote else \
            [list(g) for g in params.get("remote_block_ids") or []]

        # --- D worker: the real _apply_prefix_caching (nixl.trim), simulated read
        worker = _worker_for_trim(cfg, pair.d.kv_cache_config)
        d_step = getattr(pair.d, "_pdtrace_step", None)
        trim_local, trim_remote = [], []
        if has_trim_method():
            worker._pdtrace_cur_req = d_req
            trim_local, trim_remote = _trim(worker, d_local, remote)
            trim_local = [list(g) for g in trim_local]
            trim_remote = [list(g) for g in trim_remote]
            worker._pdtrace_cur_req = None
            rec.emit("nixl.read", req=d_req, step=d_step, inst="D", sim=True, local_block_ids=trim_local,
                     remote_block_ids=trim_remote, bytes=0, handle=f"sim-{n}",
                     remote_engine=str(params.get("remote_engine_id")), remote_req=p_req)
            rec.emit("nixl.read_done", req=d_req, step=d_step, inst="D", sim=True, status="DONE",
                     handle=f"sim-{n}", dur_ns=0)
        elif has_inline_trim():  # 0.20-0.21: the release's own _read_blocks, trimming inline
            trim_local, trim_remote = _inline_read(cfg, pair.d.kv_cache_config, d_local, remote, d_req, p_req,
                                                   str(params.get("remote_engine_id")), rec)
            rec.emit("nixl.read_done", req=d_req, step=d_step, inst="D", sim=True, status="DONE",
                     handle=f"sim-{n}", dur_ns=0)
        else:
            rec.emit("mark", label="no-trim", sim=True,
                     detail="this vLLM has neither _apply_prefix_caching nor the inline trim of _read_blocks: D's "
                            "read is not simulated")

        # --- D: load finished, run, decode with spec tokens
        _step(pair.d, None, 0, finished_recving={d_req})
        tok = 200
        for _ in range(decode_steps + 1):
            out, eco = _step(pair.d, d_req, tok)
            tok += 2
            if cfg.spec_method and d_req in out.num_scheduled_tokens and d_req in pair.d.requests:
                from vllm.v1.outputs import DraftTokenIds

                pair.d.update_draft_token_ids(DraftTokenIds([d_req], [[tok + i for i in range(cfg.num_spec_tokens)]]))
            if d_req not in pair.d.requests:
                break

        # --- P: D's read is done -> send_done, free
        rec.emit("nixl.send_done", req=p_req, step=getattr(pair.p, "_pdtrace_step", None), inst="P", sim=True)
        _step(pair.p, None, 0, finished_sending={p_req})
        rec.emit("mark", label="scenario-end", sim=True)
    rec.flush()
    events = list(pair.setup_events) + list((rec.events or [])[start:])
    rf = [e for e in events if e["ev"] == "nixl.request_finished" and e.get("req") == p_req]
    d_allocs = [e for e in events if e["ev"] == "sched.alloc" and e.get("req") == d_req
                and not e.get("delay_cache_blocks")]
    return PDResult(
        events=events, p_req=p_req, d_req=d_req, prompt_len=prompt_len, p_params=params,
        p_allocated=rf[0]["allocated_block_ids"] if rf else [],
        p_reported=[list(g) for g in params.get("remote_block_ids") or []],
        d_local=d_local, trim_local=trim_local, trim_remote=trim_remote,
        d_first_alloc=d_allocs[0] if d_allocs else None, faults=tuple(faults), p_blocks=p_blocks, d_blocks=d_blocks,
    )


def write_scenario_trace(path: str, events: list[dict], **header_extra: Any) -> dict:
    """Write events (e.g. PDResult.events, or several runs concatenated) as a complete trace."""
    from pdtrace.tracefile.trace import make_header, write_trace

    evs = [dict(e) for e in events]
    for e in evs:
        e.pop("id", None)
    insts = sorted({e.get("inst") for e in evs if e.get("inst") in ("P", "D", "PD")})
    header = make_header(origin="scenario", cmd=["pdtrace.testing.pd_harness"], instances=insts, **header_extra)
    return write_trace(path, header, evs)
