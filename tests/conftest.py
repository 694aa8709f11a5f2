"""Shared fixtures. vLLM-backed fixtures skip cleanly when vLLM is not importable.

The expensive pieces (vLLM import, VllmConfig + speculative config, the P/D scheduler
pair) are built once per session and cached per PDConfig.
"""

from __future__ import annotations

import importlib.util

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _need_vllm() -> None:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (pip install 'pdtrace[record]')")


@pytest.fixture(scope="session")
def pd_harness():
    """The pdtrace.testing.pd_harness module (imports vLLM)."""
    _need_vllm()
    from pdtrace.testing import pd_harness

    return pd_harness


@pytest.fixture(scope="session")
def pd_pair(pd_harness):
    """pd_pair(cfg) -> a PDPair (real P and D schedulers + in-memory recorder), one per config per session.

    Each run_pd_request(..., pair=pair) returns only its own events, so tests can share pairs.
    """
    cache: dict = {}

    def get(cfg=None):
        cfg = cfg or pd_harness.PDConfig()
        if cfg not in cache:
            cache[cfg] = pd_harness.make_pair(cfg)
        return cache[cfg]

    return get
