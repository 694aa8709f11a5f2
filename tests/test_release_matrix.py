"""scripts/release_matrix.py writes docs/releases.md from the per-release runs, and CI fails when the committed
file differs. A reason that carried the path of the release's venv changed with the venv's hash (which follows
release_venv.sh and pyproject.toml), so the matrix went stale on a change to neither vLLM nor pdtrace's verdicts:
CI failed on it once (the deepseek-v3 row of 0.28.0, after pyproject.toml changed). The ImportError below is the
one vLLM 0.28.0 raises here, copied from that release's venv."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _matrix():
    spec = importlib.util.spec_from_file_location("release_matrix", os.path.join(ROOT, "scripts", "release_matrix.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ERR = ("ImportError: cannot import name 'compile_flash_attn_varlen_func_from_specs' from "
       "'vllm.v1.attention.backends.fa_utils' (/root/.cache/pdtrace/venvs/vllm-0.28.0-{h}/lib/python3.11/"
       "site-packages/vllm/v1/attention/backends/fa_utils.py)")


def test_a_reason_does_not_change_with_the_venvs_hash():
    why = _matrix()._why
    a, b = why(ERR.format(h="9cb8fae4a9")), why(ERR.format(h="b58990da34"))
    assert a == b
    assert a.endswith("(site-packages/vllm/v1/attention/backends/fa_utils.py)")
    assert "/root" not in a


def test_the_committed_matrix_names_no_venv():
    with open(os.path.join(ROOT, "docs", "releases.md")) as fh:
        text = fh.read()
    assert ".cache/pdtrace/venvs" not in text
