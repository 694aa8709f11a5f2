"""`pdtrace repro TRACE --cause N` (issue 61): the regression test a fix lands with, runnable with pytest and vLLM
alone. Per release (fails on 0.23.0 and 0.24.0, passes elsewhere, pdtrace off the path):
tests/test_real_releases.py. Here, on the pinned vLLM that carries the fix: the written file passes, and with the
old P rule put back as a LABELLED FAULT (a conftest beside a copy of it patches
``KVCacheManager.get_block_ids_for_computed_tokens`` to ``get_block_ids``, as vLLM did before #44151's fix) the same
file fails, naming the block. What cannot be rebuilt gets one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "pdtrace" / "samples" / "demo_lookahead_misalignment.jsonl"

FAULT = '''"""LABELLED FAULT (a fixture, never vLLM): the pre-#44151 P rule. vLLM 0.32.0's Scheduler._connector_finished
asks kv_cache_manager.get_block_ids_for_computed_tokens; before the fix it took get_block_ids, the whole
allocation with the lookahead blocks."""
import pytest


@pytest.fixture(autouse=True)
def old_p_rule(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "get_block_ids_for_computed_tokens",
                        lambda self, request_id, num_computed_tokens: self.get_block_ids(request_id))
'''


def _pdtrace(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pdtrace", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_the_written_test_passes_on_fixed_vllm_and_fails_with_the_old_rule_put_back(tmp_path):
    pytest.importorskip("vllm")
    r = _pdtrace("repro", str(SAMPLE), "--cause", "1", "-o", str(tmp_path / "test_fixed.py"))
    assert r.returncode == 0 and "cause 1 (lookahead-block-misalignment)" in r.stdout, r.stderr
    text = (tmp_path / "test_fixed.py").read_text()
    assert "import pdtrace" not in text and "from pdtrace" not in text
    assert "PROMPT_LEN = 16" in text and "BLOCK_SIZE = 16" in text and "NUM_SPEC_TOKENS = 1" in text
    (tmp_path / "faulted").mkdir()
    (tmp_path / "faulted" / "test_faulted.py").write_text(text)
    (tmp_path / "faulted" / "conftest.py").write_text(FAULT)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:pdtrace",
                           "-rA", "test_fixed.py", "faulted"], capture_output=True, text=True, timeout=600,
                          cwd=str(tmp_path))
    out = proc.stdout
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert "PASSED test_fixed.py::" in out and "FAILED faulted/test_faulted.py::" in out
    assert "P handed D blocks [1, 2] for 16 computed tokens; the blocks holding them in P's block table are [1]" in out


@pytest.mark.parametrize("args, says", [
    (["--cause", "2"], "the trace has 1 root cause(s), 1-1"),
    ([], "give one of --cause N"),
    (["--cause", "1", "--request", "req-1-P"], "give one of --cause N"),
])
def test_what_repro_cannot_do_is_one_line_and_exit_2(tmp_path, args, says):
    r = _pdtrace("repro", str(SAMPLE), *args, "-o", str(tmp_path / "t.py"))
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "t.py").exists()


def test_a_cause_of_another_class_or_a_damaged_trace_is_one_line_and_exit_2(tmp_path):
    r = _pdtrace("repro", str(ROOT / "sample_traces" / "dflash_window_buggy.jsonl"), "--cause", "1", "-o",
                 str(tmp_path / "t.py"))
    assert r.returncode == 2 and "cannot be rebuilt yet" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(SAMPLE.read_text().splitlines()[0] + "\n{not json\n")
    r = _pdtrace("repro", str(bad), "--cause", "1", "-o", str(tmp_path / "t.py"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "t.py").exists()
