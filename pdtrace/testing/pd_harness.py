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
``FAULTS``, ``new_recorder``, ``write_scenario_trace``.
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

    def label(self) -> str:
        spec = f"{self.spec_method}k{self.num_spec_tokens}" if self.spec_method else "nospec"
        attn = "" if self.attn == ("full",) else "-" + "+".join(self.attn) + f"{self.window}"
        return (f"{spec}-bs{self.block_size}" + attn + ("-hybrid" if self.hybrid else "")
                + ("-async" if self.async_scheduling else ""))


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
                         is_encoder_decoder=False, async_scheduling=cfg.async_scheduling)
    cc = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=True)
    kvt = KVTransferConfig(kv_connector="NixlConnector", kv_role=ROLE_KV[inst],
                           engine_id=f"pdtrace-{inst}{cfg.engine_tag}-{cfg.label()}")
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
    """Apply the scheduler-side hooks (subsystems 'scheduler' and 'nixl') now; {hook: status}.

    Only these two: the worker-side subsystems target the GPU model runner, which the
    harness does not run (importing it is slow and pointless here).
    """
    import importlib

    from pdtrace import hooks

    importlib.import_module("pdtrace.hooks.scheduler")
    importlib.import_module("pdtrace.hooks.nixl")
    out = {}
    for spec in list(hooks.REGISTRY.values()):
        if spec.subsystem not in ("scheduler", "nixl"):
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
    rec.flush()
    setup = [e for e in (rec.events or [])[start:]
             if e["ev"] in ("sched.config", "proc.role", "hooks.status", "hook.error")]
    return PDPair(cfg, p, d, rec, setup)


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
    (rec or _recorder.get() or new_recorder()).emit(
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
    (rec or _recorder.get() or new_recorder()).emit(
        "fault.inject", rule="dflash-lookahead-" + variant, sim=True,
        inst=getattr(scheduler, "_pdtrace_inst", "-"),
        detail=f"Scheduler.num_lookahead_tokens {old} -> {new} (DFlash needs k+1 = {scheduler.num_spec_tokens + 1})")
    scheduler.num_lookahead_tokens = new
    try:
        yield
    finally:
        scheduler.num_lookahead_tokens = old


FAULTS = ("old_p_block_rule", "old_dflash_lookahead")


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


def _make_request(rid: str, prompt: list[int], max_tokens: int, kv: dict | None, block_size: int) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))
    r.kv_transfer_params = kv
    return r


def drive(sched: Any, draft_k: int = 0, max_steps: int = 10_000) -> int:
    """Steps a Scheduler until it has no requests (or ``max_steps``); returns the steps.

    Each step: schedule(), a ModelRunnerOutput that samples one token per request that
    finished its prompt this step (two, i.e. one draft accepted, when drafts were scheduled
    for it; none for a partial prefill chunk), update_from_output(), and with ``draft_k``
    drafts of that length for every running request past its prompt
    (update_draft_token_ids). No model runs: the scheduler, KV cache manager and connector
    scheduler side are vLLM's own."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    steps = 0
    while sched.has_requests() and steps < max_steps:
        out = sched.schedule()
        spec = out.scheduled_spec_decode_tokens
        ids, toks = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests.get(rid)
            if req is None:
                continue
            ids.append(rid)
            if req.num_computed_tokens + out.num_scheduled_tokens[rid] < req.num_prompt_tokens:
                toks.append([])  # partial prefill: nothing sampled
            else:
                toks.append([5, 6] if spec.get(rid) else [5])
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=toks))
        if draft_k:
            running = [r.request_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
            if running:
                sched.update_draft_token_ids(DraftTokenIds(running, [[7] * draft_k for _ in running]))
        steps += 1
    return steps


def _mro(sched_out: Any, tokens: dict[str, list[int]], finished_sending: set | None = None,
         finished_recving: set | None = None) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = [r for r in sched_out.num_scheduled_tokens if r in tokens]
    kvo = None
    if finished_sending or finished_recving:
        kvo = KVConnectorOutput(finished_sending=finished_sending or None, finished_recving=finished_recving or None)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[tokens[r] for r in ids], kv_connector_output=kvo)


def _tokens_for(sched_out: Any, req_id: str, next_tok: int) -> dict[str, list[int]]:
    """Sampled tokens for a scheduled request: accept the first draft token, if any."""
    if req_id not in sched_out.num_scheduled_tokens:
        return {}
    n_spec = len(sched_out.scheduled_spec_decode_tokens.get(req_id, ()))
    return {req_id: [next_tok, next_tok + 1] if n_spec else [next_tok]}


def _step(sched: Any, req_id: str | None, next_tok: int, **kvo: Any) -> tuple[Any, dict]:
    out = sched.schedule()
    toks = _tokens_for(out, req_id, next_tok) if req_id else {}
    req = sched.requests.get(req_id) if req_id else None
    if toks and req is not None and req.num_computed_tokens < req.num_prompt_tokens:
        toks = {req_id: []}  # a partial prefill chunk (schedule() already counted it): nothing sampled
    eco = sched.update_from_output(out, _mro(out, toks, **kvo))
    return out, eco


def _kv_params_from(eco: dict, req_id: str) -> dict | None:
    for outs in eco.values():
        for o in outs.outputs:
            if o.request_id == req_id and o.kv_transfer_params:
                return dict(o.kv_transfer_params)
    return None


def _worker_for_trim(cfg: PDConfig, kv_cache_config: Any) -> Any:
    """A NixlPullConnectorWorker with only what ``_apply_prefix_caching`` reads."""
    from vllm.v1.kv_cache_interface import MambaSpec

    w = object.__new__(_pull_worker_cls())
    w._physical_blocks_per_logical_kv_block = 1  # read by the hybrid branch of the pre-0.26 trim
    specs = [type(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    w._has_mamba = any(issubclass(s, MambaSpec) for s in specs)
    w._group_spec_types = tuple(specs)
    w._pdtrace_inst = "D"  # read by the nixl.trim hook (a real worker takes the process's instance)
    return w


def _pull_worker_cls() -> Any:
    """The NIXL worker class that reads on D: NixlPullConnectorWorker from 0.24.0 (the pull/push
    split), before it the one worker class (``_inline_worker_cls``); None if there is neither."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    except ImportError:
        return _inline_worker_cls()
    return NixlPullConnectorWorker


def has_trim_method() -> bool:
    """Whether this vLLM's NIXL worker has ``_apply_prefix_caching`` (0.22.0 on)."""
    return hasattr(_pull_worker_cls(), "_apply_prefix_caching")


def has_inline_trim() -> bool:
    """Whether this vLLM's NIXL worker trims inside ``_read_blocks(local_block_ids, remote_block_ids, ...)``
    (0.19.x-0.21.x)."""
    import inspect

    cls = _inline_worker_cls()
    return cls is not None and \
        list(inspect.signature(cls._read_blocks).parameters)[1:3] == ["local_block_ids", "remote_block_ids"]


def _inline_worker_cls() -> Any:
    """The NIXL worker class of a release before the pull/push split: nixl/worker.py (0.20-0.23) or
    the one-file nixl_connector.py (0.19.x); None from 0.24 on."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker as cls
    except ImportError:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import NixlConnectorWorker as cls
        except ImportError:
            return None
    return cls


def _inline_read(cfg: PDConfig, kv_cache_config: Any, local: list, remote: list, d_req: str, p_req: str,
                 remote_engine: str, rec: Recorder) -> tuple[list, list]:
    """Run the release's real ``NixlConnectorWorker._read_blocks`` (0.20-0.21), hooks on, on a worker
    built with ``object.__new__`` and given what that method reads; the NIXL agent is a stand-in that
    keeps the descriptor ids the release computed (one region: a descriptor id is the block id) and
    posts nothing. Returns the (local, remote) block lists the release read, per group, as it
    handed them to NIXL, not as any hook saw them."""
    import collections
    from types import SimpleNamespace

    from pdtrace.testing import worker_sim as ws

    NixlConnectorWorker = _inline_worker_cls()
    posted: list[tuple] = []

    def make_prepped_xfer(op: str, local_handle: Any, local_descs: Any, remote_handle: Any, remote_descs: Any,
                          notif_msg: Any = None) -> int:
        posted.append(([int(x) for x in local_descs], [int(x) for x in remote_descs]))
        return len(posted)

    n_groups = len(kv_cache_config.kv_cache_groups)
    w = object.__new__(NixlConnectorWorker)
    w.__dict__.update(
        # P and D with the same block size: ratio 1 (0.20-0.21 ask transfer_topo, 0.19.x kv_topo)
        transfer_topo=SimpleNamespace(get_engine_info=lambda e: SimpleNamespace(remote_block_size=cfg.block_size),
                                      block_size_ratio=lambda b: 1),
        kv_topo=SimpleNamespace(block_size_ratio_from_engine_id=lambda e: 1),
        world_size=1, kv_cache_config=kv_cache_config, _is_mamba_group=[False] * n_groups, _is_hma_required=False,
        _has_mamba=False, num_regions=1, engine_id="pdtrace-D-local",
        dst_num_blocks={remote_engine: cfg.num_blocks, "pdtrace-D-local": cfg.num_blocks},
        nixl_wrapper=SimpleNamespace(make_prepped_xfer=make_prepped_xfer, transfer=lambda h: None,
                                     send_notif=lambda *a, **k: None, release_xfer_handle=lambda h: None),
        _recving_transfers=collections.defaultdict(list), _pdtrace_inst="D")
    with ws._simulated(rec):  # the READ itself is not real: its events are marked sim
        w._read_blocks(local, remote, remote_engine, d_req, p_req, 0, 0, 0)
    if not posted:
        return [[] for _ in local], [[] for _ in remote]
    loc, rem = posted[-1]
    if n_groups != 1:
        raise RuntimeError("the inline-trim harness handles one KV cache group")
    return [loc], [rem]


def _trim(worker: Any, local: list, remote: list) -> tuple:
    """The real ``_apply_prefix_caching`` of the installed release, one physical block per logical block:
    (decode_block_ids, prefill_block_ids, decode_ppl, prefill_ppl) from 0.26, (local_block_ids,
    remote_block_ids, remote_ppl) in 0.22.0-0.25.x."""
    import inspect

    n_extra = len(inspect.signature(worker._apply_prefix_caching).parameters) - 2
    return worker._apply_prefix_caching(local, remote, *([1] * n_extra))


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
        pr = _make_request(p_req, prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None}, cfg.block_size)
        pair.p.add_request(pr)
        params = None
        for _ in range(8):
            out, eco = _step(pair.p, p_req, 100)
            params = _kv_params_from(eco, p_req)
            if params is not None:
                break
        if params is None:
            raise RuntimeError("P did not finish the request / produced no kv_transfer_params")
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
