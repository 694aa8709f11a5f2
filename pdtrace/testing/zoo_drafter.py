"""The drafter's own layers in the architecture zoo (issue 59): built as the worker's proposer
builds them, so the KV cache groups are the ones vLLM serves with a drafter beside the target.

vLLM's GPU model runner loads the drafter in ``load_model`` through its proposer: EAGLE / MTP by
``EagleProposer``, a draft model by ``DraftModelProposer`` (vllm/v1/spec_decode/). The proposer's
own ``_get_model`` makes the draft VllmConfig (``_create_draft_vllm_config``), sets the model tag
and the layer prefix ("draft_model" for a draft model, the target's layer count as the EAGLE / MTP
layers' first index) and calls ``get_model``. Here that method runs as released on a proposer made
with ``object.__new__`` (a faithful minimal caller: its constructor allocates device buffers), with
only ``get_model`` swapped for vLLM's own ``initialize_model`` on torch's meta device: the layers
are constructed, no weights are loaded. The drafter's attention layers register in the same
static forward context as the target's, where the worker's ``get_kv_cache_spec`` finds them.
ngram / suffix drafting has no layers.
"""

from __future__ import annotations

from typing import Any


def proposer_class(method: str) -> Any:
    """The proposer class vLLM's GPU model runner picks for ``method`` (None: no drafter layers)."""
    if method == "draft_model":
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer
    if method in ("eagle", "eagle3", "mtp") or method.endswith("_mtp"):
        from vllm.v1.spec_decode.eagle import EagleProposer

        return EagleProposer
    return None


def build_drafter_layers(vc: Any) -> tuple[list[str], str | None]:
    """Construct the drafter of ``vc``'s speculative config on the meta device, as its proposer
    does: the names of the attention layers it added (none without a drafter model), and why it
    could not be built (vLLM's exception), None when it was. A drafter that fails half-built leaves
    no layer behind: the family is then checked on the target's layers alone, and says so."""
    import torch
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model

    from .zoo_models import _reason

    sc = vc.speculative_config
    cls = proposer_class(sc.method) if sc is not None else None
    if cls is None:
        return [], None
    context = vc.compilation_config.static_forward_context
    before = set(context)
    proposer = object.__new__(cls)
    proposer.vllm_config, proposer.speculative_config = vc, sc
    namespace = cls._get_model.__globals__  # the module whose get_model the proposer calls

    def on_meta(*, vllm_config: Any, model_config: Any = None, prefix: str = "", load_config: Any = None) -> Any:
        with torch.device("meta"):
            return initialize_model(vllm_config=vllm_config, model_config=model_config or vllm_config.model_config,
                                    prefix=prefix)

    real = namespace["get_model"]
    namespace["get_model"] = on_meta
    try:
        proposer._get_model()
    except Exception as exc:  # noqa: BLE001 - vLLM's reason, said in the zoo's output
        for name in set(context) - before:
            del context[name]
        return [], _reason(exc)
    finally:
        namespace["get_model"] = real
    return sorted(set(get_layers_from_vllm_config(vc, AttentionLayerBase)) - before), None
