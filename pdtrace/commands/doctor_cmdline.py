"""`pdtrace doctor -- CMD`: vLLM's own model-runner choice for one server command line.

The command line is parsed with vLLM's own server argument parser (``make_arg_parser``, wherever
this vLLM keeps it), turned into engine arguments (``AsyncEngineArgs.from_cli_args``) and a
``VllmConfig`` (``create_engine_config``), as ``vllm serve`` does before it starts an engine; then
``VllmConfig.use_v2_model_runner`` is read, and, when it says V1, the features vLLM names
(``_get_v2_model_runner_unsupported_features``). Building the config needs what the server needs
for it (the model's config files readable here, the same environment variables); it loads no
weights and starts no process. Whatever fails is one line of why, and doctor falls back to the
estimate from vLLM's code facts (``doctor_coverage.default_runner``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Where vLLM keeps the server's argument parser, newest first (0.33, 0.32, earlier).
PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                  "vllm.entrypoints.openai.cli_args")


def server_args(cmd: list[str]) -> list[str] | None:
    """The server's own arguments out of a launch command, or None if it launches no vLLM server.

    Understood: ``vllm serve ...``, ``python -m vllm.entrypoints.openai.api_server ...`` (any
    ``vllm.entrypoints...api_server`` module), ``python -m vllm.entrypoints.cli.main serve ...``."""
    for k, tok in enumerate(cmd):
        if os.path.basename(tok) == "vllm" and cmd[k + 1:k + 2] == ["serve"]:
            return cmd[k + 2:]
        if tok == "-m" and k + 1 < len(cmd):
            mod = cmd[k + 1]
            if mod.startswith("vllm.entrypoints") and mod.endswith("api_server"):
                return cmd[k + 2:]
            if mod in ("vllm.entrypoints.cli.main", "vllm") and cmd[k + 2:k + 3] == ["serve"]:
                return cmd[k + 3:]
    return None


def _parser() -> Any:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in PARSER_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "make_arg_parser"):
            return mod.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    raise ImportError("no make_arg_parser in " + ", ".join(PARSER_MODULES))


def evaluate(cmd: list[str]) -> dict[str, Any]:
    """{"ok": True, "runner": "v1"|"v2", ...} from vLLM's own config, or {"ok": False, "why": ...}."""
    args = server_args(cmd)
    out: dict[str, Any] = {"command": cmd}
    if args is None:
        return {**out, "ok": False, "why": "not a vLLM server command: expected `vllm serve ARGS` or "
                "`python -m vllm.entrypoints.openai.api_server ARGS`"}
    try:
        ns = _parser().parse_args(args)
    except SystemExit:
        return {**out, "ok": False, "why": "vLLM's argument parser rejected these arguments (its message is above)"}
    except Exception as exc:
        return {**out, "ok": False, "why": f"vLLM's argument parser is unavailable: {type(exc).__name__}: {exc}"[:300]}
    if getattr(ns, "model_tag", None):
        ns.model = ns.model_tag  # as `vllm serve MODEL` does (entrypoints/cli/serve.py)
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
    except Exception as exc:
        return {**out, "ok": False,
                "why": " ".join(f"vLLM could not build this command's config here: {type(exc).__name__}: {exc}"
                                .split())[:400]}
    v2 = bool(cfg.use_v2_model_runner)
    unsupported = []
    if not v2 and hasattr(cfg, "_get_v2_model_runner_unsupported_features"):
        try:
            unsupported = list(cfg._get_v2_model_runner_unsupported_features())
        except Exception:
            unsupported = []
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        HAS_TRITON = None
    model_cfg = getattr(cfg, "model_config", None)
    spec = getattr(cfg, "speculative_config", None)
    kvt = getattr(cfg, "kv_transfer_config", None)
    from vllm.platforms import current_platform

    return {**out, "ok": True, "runner": "v2" if v2 else "v1", "unsupported_features": unsupported,
            "env_VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
            "platform": getattr(current_platform, "device_type", "?"),
            "spec_method": getattr(spec, "method", None), "kv_connector": getattr(kvt, "kv_connector", None),
            "async_scheduling": getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", None),
            "triton": HAS_TRITON, "hybrid": getattr(model_cfg, "is_hybrid", None)}


# vLLM copies accepted-token counts to the CPU only for hybrid (Mamba / linear-attention) models
# (GPUModelRunner._update_states_after_model_execute; pdtrace.detectors.coverage says the same
# from a trace's KV cache groups): for any other model the stale-read class cannot occur.
NOT_HYBRID = ("does not apply: the model is not hybrid (no Mamba / linear-attention layers), and vLLM "
              "copies accepted counts to the CPU only for hybrid models")


def verdicts(res: dict[str, Any], cov: list[dict[str, Any]]) -> dict[str, str]:
    """Per bug class, the doctor verdict under this command's runner (and model)."""
    out = {c["class"]: c[res["runner"]] for c in cov}
    if res.get("hybrid") is False and "stale-accepted-count-read" in out \
            and not out["stale-accepted-count-read"].startswith("not checked"):
        out["stale-accepted-count-read"] = NOT_HYBRID
    return out


def why_line(res: dict[str, Any]) -> str:
    if not res["ok"]:
        return res["why"]
    bits = []
    if res["env_VLLM_USE_V2_MODEL_RUNNER"] is not None:
        bits.append(f"VLLM_USE_V2_MODEL_RUNNER={res['env_VLLM_USE_V2_MODEL_RUNNER']}")
    if res["runner"] == "v1" and res["env_VLLM_USE_V2_MODEL_RUNNER"] is None and res.get("triton") is False:
        bits.append("Triton is not installed here")
    if res["unsupported_features"]:
        bits.append("V2 does not support " + ", ".join(res["unsupported_features"]))
    bits.append(f"platform {res['platform']}")
    if res["spec_method"]:
        bits.append(f"spec {res['spec_method']}")
    if res["kv_connector"]:
        bits.append(res["kv_connector"])
    if res["async_scheduling"] is not None:
        bits.append("async scheduling " + ("on" if res["async_scheduling"] else "off"))
    return "VllmConfig.use_v2_model_runner for this command: " + ", ".join(bits)
