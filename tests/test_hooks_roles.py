"""Process roles come from vLLM's own objects (real vLLM 0.32.0 code on CPU)."""

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from pdtrace import hooks, recorder  # noqa: E402
from pdtrace.recorder import Recorder  # noqa: E402


def test_worker_announces_role_instance_and_rank():
    from vllm.v1.worker.worker_base import WorkerBase

    from pdtrace.testing import pd_harness

    hooks.install_now()
    assert hooks.REGISTRY["worker.init"].status == "applied"
    rec = Recorder.in_memory()
    prev = recorder.set_current(rec)
    try:
        vc = pd_harness.build_vllm_config("D", pd_harness.PDConfig())
        WorkerBase(vc, local_rank=0, rank=1, distributed_init_method="tcp://127.0.0.1:0")  # the real __init__
        rec.emit("mark", label="after")
    finally:
        recorder.set_current(prev)
    rec.flush()
    (role,) = [e for e in rec.events if e["ev"] == "proc.role"]
    assert (role["new_role"], role["new_inst"], role["rank"]) == ("worker", "D", 1)
    after = rec.events[-1]
    assert (after["role"], after["inst"], after["rank"]) == ("worker", "D", 1)  # later events carry it


def test_api_server_hook_targets_the_real_build_app():
    status, why = hooks.check(hooks.REGISTRY["worker.api_server"])
    assert status == "ok", why
