"""D's NIXL worker side in ``pd_harness``: the installed release's real
``_apply_prefix_caching`` (its trim of P's reported blocks) or, in 0.19-0.21, the trim inside
``_read_blocks`` (run with a stand-in NIXL agent), on a worker built with ``object.__new__``
and given only what those methods read."""

from __future__ import annotations

from typing import Any

from pdtrace.record.recorder import Recorder


def _worker_for_trim(cfg: Any, kv_cache_config: Any) -> Any:
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


def _inline_read(cfg: Any, kv_cache_config: Any, local: list, remote: list, d_req: str, p_req: str,
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
