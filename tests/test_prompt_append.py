"""D's prompt one token longer than P's (vLLM #50558), on real vLLM code: P's and D's real
``Scheduler`` with the NIXL connector's scheduler side, D's own prefix cache, and the release's
own ``_apply_prefix_caching`` on the lists D's connector metadata carries
(``pdtrace.testing.prompt_append``; the read itself does not run). The "proxy" is D's request =
P's prompt + P's first sampled token, as vLLM PR #50559's toy proxy sends it.

The oracle is vLLM's lists and vLLM's own exception, never the detector: D's block list puts each
block it loads into at a token block, P's report holds token block i at index i for the blocks P
computed tokens into, and the trim either raised or paired them (``Appended.misplaced``). Which
outcome a release gives differs (0.32 / 0.33 assert or shift; 0.24 also pairs D's extra block
with a P block that holds no KV, and its lookahead rule shifts as seed 000 says): the test holds
the detector to whatever the release's lists say, and holds every release to not pairing the
appended case right."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdtrace.detectors import run_all  # noqa: E402
from pdtrace.detectors.base import LOOKAHEAD_MISALIGNMENT, SEVERITY_ERROR  # noqa: E402
from pdtrace.testing.pd_harness import PDConfig  # noqa: E402
from pdtrace.testing.prompt_append import appended_first_token  # noqa: E402

pytestmark = pytest.mark.vllm
SPECS = [PDConfig(spec_method=""), PDConfig(spec_method="eagle")]


def _found(r):
    return [f for f in run_all(r.events) if f.kind == LOOKAHEAD_MISALIGNMENT and f.severity == SEVERITY_ERROR]


def _judged_as_vllm_says(r) -> str:
    """The detector's verdict against the lists: 'raised', 'misplaced' or 'clean'."""
    found = _found(r)
    if r.raised:
        (trim,) = r.of("nixl.trim")
        assert trim["raised"] == r.raised and trim["local_out"] == [[]]
        (f,) = found
        assert "local > remote" in f.title and f.data["unpaired_local"] == r.past_p(), (f.title, r)
        return "raised"
    off = r.misplaced()
    if off:
        (f,) = found
        wrong = [(p["local"], p["remote"], p["expected"]) for g in f.data["groups"] for p in g["pairs"]
                 if not p["ok"]]
        assert wrong == off, (f.title, r)
        return "misplaced"
    assert found == [], [f.title for f in found]
    return "clean"


@pytest.mark.parametrize("cfg", SPECS, ids=["nospec", "eagle"])
@pytest.mark.parametrize("cached", [0, 3])
def test_a_block_boundary_prompt_plus_the_first_token_is_caught(cfg, cached):
    """64 tokens (4 blocks of 16) + the appended token, with or without D's own prefix hit:
    vLLM's trim raises (D holds more blocks to load than P reported) or pairs D's blocks with P's
    blocks of other tokens; never right. The trace records the raise; check names the blocks."""
    r = appended_first_token(cfg, 64, d_cached_blocks=cached)
    assert _judged_as_vllm_says(r) != "clean"
    assert r.past_p()  # D loads into a block of tokens P never computed: the appended token's


@pytest.mark.parametrize("cfg", SPECS, ids=["nospec", "eagle"])
@pytest.mark.parametrize("prompt_len,append", [(63, True), (65, True), (64, False)])
@pytest.mark.parametrize("cached", [0, 3])
def test_other_prompts_judged_as_vllms_lists_say(cfg, prompt_len, append, cached):
    """Off the block boundary (63 + 1 tokens fill P's last block; 65 + 1 fit in it) or without the
    appended token, D's list ends where P's does; check agrees with the lists (clean on 0.32+)."""
    r = appended_first_token(cfg, prompt_len, d_cached_blocks=cached, append=append)
    _judged_as_vllm_says(r)
    assert not r.past_p() or (prompt_len == 65 and r.raised is None)  # (65 + 1: D's block 4 is P's block 4)


def test_on_this_release_the_two_outcomes_of_the_report():
    """vLLM 0.30+ (0.32.0 / 0.33.0 carry no fix for #50558): no prefix hit -> the trim asserts; D's
    prefix hit -> the pairing is shifted by one block, silently."""
    import vllm
    from packaging.version import Version

    got = (_judged_as_vllm_says(appended_first_token(SPECS[0], 64)),
           _judged_as_vllm_says(appended_first_token(SPECS[0], 64, d_cached_blocks=3)))
    if Version(vllm.__version__.split("+")[0]) >= Version("0.30.0"):
        assert got == ("raised", "misplaced")
    else:  # (older releases: other outcomes, as their lists say; never right)
        assert "clean" not in got


def test_repro_writes_a_vllm_test_that_fails_on_both_outcomes(tmp_path):
    """`pdtrace repro --cause 1` on each outcome's trace (P's 64 tokens, D sent 65; D's prefix cache empty or
    holding 3 blocks) writes a test that runs with pytest and vLLM alone: it fails on this release (#50558 is open
    in every release pdtrace installs; by hand: 0.22.1-0.33.0 fail, 0.19.1 and 0.20.0 skip, having no
    _apply_prefix_caching), and the same file with D's prompt cut back to P's (no appended token) passes: the test
    can pass, and what it catches is the longer prompt. Oracle: vLLM's own block lists, in the written test."""
    import os
    import subprocess
    import sys

    from pdtrace.commands import repro
    from pdtrace.tracefile.writer import make_header, write_trace

    for name, cached in (("nocache", 0), ("cached", 3)):
        r = appended_first_token(SPECS[0], 64, d_cached_blocks=cached)
        write_trace(str(tmp_path / f"{name}.jsonl"), make_header(origin="scenario", scenario=f"prompt_append {name}"),
                    [{k: v for k, v in e.items() if k != "id"} for e in r.events])
        assert repro.run(str(tmp_path / f"{name}.jsonl"), cause=1, output=str(tmp_path / f"test_{name}.py")) == 0
        text = (tmp_path / f"test_{name}.py").read_text()
        assert "P_LEN = 64" in text and "D_LEN = 65" in text and f"D_CACHED_BLOCKS = {cached}" in text
        (tmp_path / f"test_{name}_no_append.py").write_text(text.replace("D_LEN = 65", "D_LEN = 64"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_TARGET_DEVICE")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:pdtrace", "-rA",
                           "."], capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    out = proc.stdout
    for name in ("nocache", "cached"):
        assert f"FAILED test_{name}.py::" in out and f"PASSED test_{name}_no_append.py::" in out, out[-3000:]
    assert "D's _apply_prefix_caching asserts (num_decode_blocks <= len(prefill))" in out, out[-3000:]
    assert "D's block 4 holds token block 3 of" in out and "reads P's block 3, token block 2" in out, out[-3000:]
