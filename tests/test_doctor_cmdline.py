"""`pdtrace doctor -- CMD`: vLLM's own model-runner choice for a server command line.

Real parts: vLLM's own server argument parser, AsyncEngineArgs and VllmConfig (create_engine_config)
on a tiny random-weight Llama + EAGLE drafter written to disk (scripts/make_tiny_models.py), on
CPU. Here vLLM has no Triton, so its own property picks V1; forcing V2 makes vLLM refuse the config
("Model Runner V2 requires Triton"), which doctor reports as the reason. The V2 answer on a GPU
host comes from the same property (docs/live-gpu.md: doctor on the H100 said V2, and the workers
built V2).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrace.commands.doctor_cmdline import server_args

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.vllm


def test_server_args_understands_the_launch_forms():
    assert server_args(["vllm", "serve", "m", "--port", "1"]) == ["m", "--port", "1"]
    assert server_args(["/venv/bin/vllm", "serve", "m"]) == ["m"]
    assert server_args(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]) == ["--model", "m"]
    assert server_args(["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"]) == ["m"]
    assert server_args(["python", "-c", "print(1)"]) is None
    assert server_args(["vllm", "bench", "serve"]) is None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_tiny_models

    return make_tiny_models.build(tmp_path_factory.mktemp("models"), eagle=True)


def _doctor(cmd, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    env.update({"HF_HUB_OFFLINE": "1", **(env_extra or {})})
    r = subprocess.run([sys.executable, "-m", "pdtrace", "doctor", "--json", "--", *cmd],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    return json.loads(r.stdout)["command"]


def test_vllm_picks_the_runner_for_this_command(models):
    spec = json.dumps({"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 3})
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    res = _doctor(["vllm", "serve", models["target"], "--max-model-len", "512", "--speculative-config", spec,
                   "--kv-transfer-config", kv])
    assert res["ok"], res
    # vLLM's own VllmConfig.use_v2_model_runner: no Triton on this CPU host -> V1
    assert res["runner"] == "v1" and res["triton"] is False and res["platform"] == "cpu"
    assert res["spec_method"] == "eagle" and res["kv_connector"] == "NixlConnector"
    assert res["hybrid"] is False
    cov = res["coverage"]
    assert cov["lookahead-block-misalignment"].startswith("recorded")
    assert cov["connector-metadata-cleared-before-drafter"].startswith("recorded")
    assert cov["drafter-window-outside-allocation"].startswith("recorded")
    # the model is a plain Llama: vLLM never copies accepted counts to the CPU for it
    assert cov["stale-accepted-count-read"].startswith("does not apply: the model is not hybrid")


def test_forcing_v2_gives_vllms_own_answer(models):
    import vllm

    res = _doctor(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", models["target"],
                   "--max-model-len", "512"], {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    if vllm.__version__.startswith("0.32"):
        # 0.32.0's VllmConfig refuses V2 without Triton while it is built: doctor passes that on
        assert not res["ok"] and "Model Runner V2 requires Triton" in res["why"] and "\n" not in res["why"]
        assert res["coverage"] is None
    else:
        # 0.33.0 builds the config and says V2 (the worker would fail later, on the missing Triton)
        assert res["ok"] and res["runner"] == "v2" and res["env_VLLM_USE_V2_MODEL_RUNNER"] == "1"
        assert "spec_v2.target_forward" in res["coverage"]["connector-metadata-cleared-before-drafter"]


def test_a_command_that_is_not_a_vllm_server(models):
    res = _doctor(["python", "-c", "print(1)"])
    assert not res["ok"] and res["why"].startswith("not a vLLM server command")
    r = subprocess.run([sys.executable, "-m", "pdtrace", "doctor", "--", "python", "-c", "print(1)"],
                       capture_output=True, text=True, timeout=300)
    assert "model runner: unknown (not a vLLM server command" in r.stdout
