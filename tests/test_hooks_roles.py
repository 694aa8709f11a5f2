"""Process roles come from vLLM's own objects (real vLLM 0.32.0 code on CPU)."""

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from pdtrace import hooks
from pdtrace.record import recorder  # noqa: E402
from pdtrace.record.recorder import Recorder  # noqa: E402


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


def test_forced_instance_names_every_scheduler_event(tmp_path):
    """`pdtrace record --instance D2` (env PDTRACE_INSTANCE) wins over the kv_role: a second
    decoder of an xPyD run must not be recorded as "D". A fresh process (the hooks read the
    variable at import) builds a real kv_consumer Scheduler and runs one request through the
    real P/D pair of the harness; every event of the schedulers and their connectors names D2.
    (The harness's worker-side NIXL calls name their instance themselves: one process plays both
    workers there. In a live 1P2D run every event of D2's worker process said D2.)"""
    import json
    import os
    import subprocess
    import sys

    prog = (
        "import json; from pdtrace.testing import pd_harness as h\n"
        "pair = h.make_pair(h.PDConfig())\n"
        "res = h.run_pd_request(h.PDConfig(), 40, pair=pair)\n"
        "print(json.dumps(sorted({(e['ev'], e.get('inst')) for e in res.events\n"
        "                         if e['ev'].startswith(('sched.', 'req.', 'nixl.remote_alloc', 'nixl.request_finished'))})))\n")
    env = dict(os.environ, PDTRACE_INSTANCE="D2")
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pairs = json.loads(out.stdout.strip().splitlines()[-1])
    assert pairs and {inst for _ev, inst in pairs} == {"D2"}, pairs
    assert {"sched.config", "sched.alloc", "nixl.remote_alloc"} <= {ev for ev, _ in pairs}
