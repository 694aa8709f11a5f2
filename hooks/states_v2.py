"""Model runner V2 (``vllm/v1/worker/gpu/``): request rows and where accepted counts live.

Rows. V2 keeps every per-request buffer -- the block table (``gpu/block_table.py``,
``append_block_ids(req_index, ...)``), ``RequestState``'s arrays, the model state's
``num_accepted_tokens_gpu`` -- in a row (a "slot") that ``gpu/states.py:RequestState``
hands out in ``add_request`` (``free_indices.pop()``) and takes back in ``remove_request``
(``free_indices.append``: the next request added reuses it at once). The per-step
``gpu/input_batch.py:InputBatch`` is rebuilt every step from those slots
(``idx_mapping[batch row] = slot``); it holds no state that outlives the step, so rows never
move the way V1's ``swap_states`` / ``condense`` move them and there is nothing more to
record there. The slot is what V1's InputBatch row is to the detectors:

- ``states_v2.add``: after ``RequestState.add_request(req_id, ...)`` -> ``batch.add`` with
  ``row`` = the slot, ``runner: "v2"``.
- ``states_v2.remove``: after ``RequestState.remove_request(req_id)`` when it freed a slot
  -> ``batch.remove`` (``GPUModelRunner.add_requests`` first removes every new request in
  case it is a streaming re-add; a remove that found nothing records nothing).

Accepted counts. V2 never copies them to the CPU: ``gpu/model_states/mamba_hybrid.py``
``MambaHybridModelState`` keeps ``num_accepted_tokens_gpu`` (one entry per slot, on the
runner's device), written by ``postprocess_state`` with a Triton kernel and gathered by
``prepare_attn`` with ``idx_mapping`` (device indexing); nothing in ``gpu/`` reads it on the
host (checked in 0.32.0 and 0.33.0). Bug class 004 (a stale CPU read of a non-blocking copy)
therefore has no code path on V2.

- ``states_v2.acc_device``: after ``MambaHybridModelState.__init__`` -> ``acc.device``: the
  holder class, the attribute, its device (``tensor.device``, no sync), that it is keyed by
  slot, and ``cpu_copy``: whether the object holds any other accepted-count buffer on the
  host (an attribute whose name has "accepted" and that is a NumPy array or a CPU tensor
  other than the device buffer itself). ``pdtrace check`` reads it to report the stale-read
  class as "does not apply" for that worker instead of "not checked".

Every target is plain Python / CPU bookkeeping: ``RequestState`` builds on CPU (with
``vllm/v1/worker/cpu/buffer_utils.UvaBuffer``, which vLLM's CPU worker substitutes for the
pinned-memory one) and the tests drive its real methods. No CUDA call, no I/O.

Verified against vLLM 0.32.0 and 0.33.0: ``add_request(self, req_id, prompt_len, all_token_ids,
num_computed_tokens, max_tokens) -> None``, ``remove_request(self, req_id) -> int | None``,
``MambaHybridModelState.__init__(self, vllm_config, model, encoder_cache, device)``.
"""

from __future__ import annotations

from typing import Any

from pdtrace.hooks import after, register

STATES_MODULE = "vllm.v1.worker.gpu.states"
MAMBA_MODULE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
ACC_ATTR = "num_accepted_tokens_gpu"


def _rec_add(rec: Any, _result: Any, self: Any, req_id: str, *a: Any, **kw: Any) -> None:
    rec.put("batch.add", req_id, None, {"row": int(self.req_id_to_index.get(req_id, -1)), "runner": "v2"})


def _rec_remove(rec: Any, result: Any, self: Any, req_id: str, *a: Any, **kw: Any) -> None:
    if result is None:  # nothing was there (add_requests' streaming re-add guard)
        return
    rec.put("batch.remove", req_id, None, {"row": int(result), "runner": "v2"})


def _host_copies(obj: Any) -> list[str]:
    """Attributes of ``obj`` that hold accepted counts on the host, besides ``ACC_ATTR``."""
    out = []
    for name, v in vars(obj).items():
        if name == ACC_ATTR or "accepted" not in name:
            continue
        if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":
            out.append(name)
        elif getattr(getattr(v, "device", None), "type", None) == "cpu" and hasattr(v, "numel"):
            out.append(name)
    return sorted(out)


def _rec_acc_device(rec: Any, _result: Any, self: Any, *a: Any, **kw: Any) -> None:
    buf = getattr(self, ACC_ATTR, None)
    if buf is None:
        return
    cls = type(self)
    copies = _host_copies(self)
    fields: dict[str, Any] = {"holder": f"{cls.__module__}.{cls.__qualname__}", "attr": ACC_ATTR,
                              "device": str(getattr(buf, "device", "")), "keyed_by": "slot",
                              "cpu_copy": bool(copies), "runner": "v2"}
    if copies:
        fields["copies"] = copies
    rec.put("acc.device", None, None, dict(fields))


ADD = register("states_v2.add", STATES_MODULE, "RequestState.add_request", ("req_id", "prompt_len"),
               after("states_v2.add", _rec_add), doc="batch.add: request id + slot (V2)", runner="v2")
REMOVE = register("states_v2.remove", STATES_MODULE, "RequestState.remove_request", ("req_id",),
                  after("states_v2.remove", _rec_remove, skip="_pdt_result is None"),
                  doc="batch.remove: request id + freed slot (V2)", runner="v2")
ACC_DEVICE = register("states_v2.acc_device", MAMBA_MODULE, "MambaHybridModelState.__init__",
                      ("vllm_config", "model", "encoder_cache", "device"),
                      after("states_v2.acc_device", _rec_acc_device),
                      doc="acc.device: accepted counts kept on the device, per slot (V2)", runner="v2")

SPECS = (ADD, REMOVE, ACC_DEVICE)
