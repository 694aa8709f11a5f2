"""vLLM #51571 recorded live on an H200 (sample_traces/live_gpu_race51571_v1_{bug,fix51599}.jsonl.zst).

Real parts: the whole run was real (vLLM 0.32.0's CUDA wheel, V1 runner, async scheduling, Mamba align mode, a
tiny NemotronH, 640 requests; provenance in sample_traces/README.md); no GPU runs here: these tests read the
recorded files. The oracle is recorded data, not the detector: the count the runner copied for each request
(``d2h.done`` values in the rows ``d2h.issue`` names), held against what ``_prepare_inputs`` read
(scripts/race_oracle.py). The fixed twin ran vLLM with the LABELLED patch scripts/patches/vllm_pr51599_approach.py.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import race_oracle  # noqa: E402

from pdtrace.detectors import STALE_ACCEPTED_COUNT_READ  # noqa: E402
from pdtrace.detectors.stale_read import detect  # noqa: E402

BUG = ROOT / "sample_traces" / "live_gpu_race51571_v1_bug.jsonl.zst"
FIX = ROOT / "sample_traces" / "live_gpu_race51571_v1_fix51599.jsonl.zst"


def test_every_wrong_read_is_an_error_naming_the_move_and_nothing_else_is():
    r = race_oracle.judge(str(BUG))
    assert r["requests"] == 640 and r["reads"] == 7700 and r["events"] == 23419  # as check counts them
    assert r["reads_with_copy_values"] >= r["reads"] - 2  # the first reads of each request precede any copy
    assert r["oracle"] == "runner's copied count" and r["wrong"] == r["wrong_by_copy"] == 70
    assert r["findings"]["error"] == 70 and r["ok"] and r["errors_without_copy_values"] == 0
    assert r["wrong_not_flagged"] == r["flagged_not_wrong"] == []
    assert r["error_moves"] == {"batch.swap": 70}
    # every other read that disagrees with acc.truth got what the runner itself copied: 1 where it accepted more
    # (the align postprocess), so it is right and is no error
    assert r["disagree_with_truth"] == r["wrong_by_copy"] + r["runner_copied_1_for_more"]
    # the approximate align rule of older recordings misses 3 of them (it calls them resets): the copy decides
    assert r["wrong_by_truth_and_align_rule"] == 67
    found = [f for f in detect(race_oracle.events(str(BUG))) if f.kind == STALE_ACCEPTED_COUNT_READ]
    errors = [f for f in found if f.severity == "error"]
    assert all("#51571" in f.explanation and "swap_states(" in f.explanation for f in errors)
    # the warnings: reads through another request's row whose value equalled the request's own copied count
    warn = [f for f in found if f.severity == "warning"]
    assert warn and all(f.data["value"] == f.data["own"] for f in warn)


def test_the_fixed_twin_reads_no_wrong_count_and_gives_no_finding():
    r = race_oracle.judge(str(FIX))
    assert r["requests"] == 640 and r["moves_with_rows"] == [False]
    assert r["moves"]["batch.swap"] > 200  # the rows moved as much as in the bug run
    assert r["wrong"] == r["wrong_by_copy"] == 0 and r["findings"] == {} and r["ok"]
    assert r["disagree_with_truth"] == r["runner_copied_1_for_more"] > 0


def test_race_oracle_cli_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "race_oracle.py"), str(BUG), str(FIX)],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.count("\n") == 2, ok.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "race_oracle.py"), str(tmp_path / "no.jsonl")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr
