"""Process roles from vLLM's own objects: a worker announces itself (with its rank) when
``WorkerBase.__init__`` runs, the API server when its FastAPI app is built. The engine core
announces itself in ``hooks/scheduler.py`` (Scheduler construction)."""

from __future__ import annotations

from typing import Any

from pdtrace import schema

from . import after, register
from .scheduler import _kv_role, inst_for_kv_role


def _worker_init(rec: Any, _result: Any, self: Any, vllm_config: Any, local_rank: int, rank: int, *a: Any, **kw: Any) -> None:
    rec.set_role(role=schema.ROLE_WORKER, inst=inst_for_kv_role(_kv_role(vllm_config)), rank=int(rank),
                 why=f"{type(self).__name__} constructed (rank {rank}, local rank {local_rank})")


register("worker.init", "vllm.v1.worker.worker_base", "WorkerBase.__init__", ("vllm_config", "local_rank", "rank"),
         after("worker.init", _worker_init), doc="proc.role: worker and its TP rank")


def _api_app(rec: Any, _result: Any, *a: Any, **kw: Any) -> None:
    rec.set_role(role=schema.ROLE_API, why="API server app built")


register("worker.api_server", "vllm.entrypoints.launchers.app", "build_app", (),
         after("worker.api_server", _api_app), doc="proc.role: api", optional=True)
