"""The seed bugs from a real vLLM release's own code, with no planted fault (issue 34).

Runs against whichever vLLM this venv has: the main suites run it on 0.32.0 and 0.33.0 (fixed
releases: nothing may be flagged), and scripts/test.sh runs it once more in each release venv
that scripts/real_bugs.sh installs (0.19.1, 0.20.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.28.0, 0.30.0).

Real parts: per ``pdtrace.testing.real_release`` (the release's Scheduler, KVCacheManager, NIXL
connector scheduler side and ``_apply_prefix_caching``; its InputBatch, reorder,
``_update_states_after_model_execute``, ``_compute_prev_positions`` and the accepted-count
statements of its ``_prepare_inputs``). Simulated: the GPU drafter's window (computed by the
runner hook from the runner's inputs) and the NIXL READ itself.

Two oracles, neither from a detector: per request, the release's own block lists / buffers
(``expected``); per release, which seed bugs it carries, from reading its sources
(../shared/vllm-releases.md), so that oracle and detector going blind together still fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from pdtrace.testing import real_release  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import repro_table  # noqa: E402  (REPRO: where each sample's written test fails, per release)

# From the released sources (../shared/vllm-releases.md), not from a run: the families a release's
# code gets wrong. seed000 in 0.20.0 and 0.22.1 is the chunked-prefill form (a later chunk
# allocates lookahead while the first schedule's zeroing covers single-chunk prompts): that file
# lists 0.16.0-0.22.1 as partial, "not tested"; this suite found it.
CARRIES = {
    "0.19.1": {"seed000-lookahead", "seed004-stale"},  # DFlash appears in 0.20.0
    "0.20.0": {"seed000-lookahead", "seed003-dflash", "seed004-stale"},
    "0.22.1": {"seed000-lookahead", "seed003-dflash", "seed004-stale"},
    "0.23.0": {"seed000-lookahead", "seed004-stale"},
    "0.24.0": {"seed000-lookahead"},
}
FIXED_FROM = (0, 25, 0)  # every seed fixed from 0.25.0 on
# Open upstream in every release tested (0.19.1-0.33.0): _update_requests_with_invalid_blocks never
# touches num_output_placeholders (read in each release's vllm/v1/core/sched/scheduler.py), so under
# async scheduling a rolled-back request is scheduled past its tokens (vLLM #49250, #45138).
OPEN = {"kv-load-rollback"}
# Also open in every release: update_from_output appends the output of the step in flight at a
# KV-load rollback (it skips only the requests of the call that handled the failure; nothing marks
# the in-flight output stale), read in each release's scheduler.py (issue 50 item 2).
OPEN |= {"kv-load-in-flight"}
# _update_requests_with_invalid_blocks lets a second request keep a shared failed block as computed
# (its marked_invalid_block_ids rule) in every release; pdtrace's harness gets the second request
# its prefix-cache hit on 0.30.0+ only (before, it prefilled the blocks itself: no shared block, the
# family is not run and says why). From 0.30.0 the release carries it (issue 50 item 1).
SHARED_FROM = (0, 30, 0)
# Not a bug of vLLM: the router's labelled fault (P's params dropped on the way to D, issue 51), run
# on each release's own schedulers so that the detector is seen to read every release's events; the
# requests it hits are wrong on every release (vLLM's own PrefillStats / num_cached_tokens say so).
ROUTER_FAULT = {"kv-never-crossed"}
# From each release's scheduler.py: 0.19.1-0.28.0 unpack `(req_block_ids,) = get_block_ids(req_id)`
# (ValueError on a multi-group model, vLLM #50687: the engine core ends); 0.30.0 recomputes
# multi-group requests whole (#50388); 0.32.0+ refuse block-level failures of multi-group models by
# design (RuntimeError, #56855, which vLLM's own tests expect: not a bug of the release).
HYBRID_RAISES = (((0, 0, 0), (0, 30, 0)),)  # [from, to) ranges
# vLLM #37285: under async scheduling a request's blocks are freed at once when its output finishes it, while its
# next step is in flight; a KV consumer can hand them to a request loading from P. PR #45357 defers the pool return to
# the fence step's output (Scheduler.deferred_frees / _drain_deferred_frees): absent from scheduler.py in 0.19.1,
# 0.20.0, 0.22.1 and 0.23.0, present from 0.24.0 (read in each release's sources; issue 59, must show 3).
REOWN_FIXED_FROM = (0, 24, 0)
# vLLM #47282: under async scheduling allocate_slots prunes a sliding window's blocks by the optimistic
# num_computed_tokens (the tokens of the step in flight included), so the block that step still reads can go to a
# request loading from P. PR #47728 prunes by `total_computed_tokens - request.num_in_flight_tokens`: absent from
# kv_cache_manager.py in 0.19.1-0.25.0 (`total_computed_tokens` alone), present from 0.26.0 (read in each release's
# wheel, 2026-11-29; issue 59, must show 3).
PRUNE_FIXED_FROM = (0, 26, 0)


def _hybrid_raises(version: str) -> bool:
    v = tuple(int(x) for x in version.split(".")[:3])
    return any(lo <= v < hi for lo, hi in HYBRID_RAISES)

# What pdtrace cannot see on a release, said here rather than skipped. 0.19-0.21's V2 runner has
# no MambaHybridModelState (the hook that says the stale-read class does not apply on V2), so that
# class is "not checked" under V2 there.
GAPS = {
    "0.19.1": {"skipped": {"states_v2.acc_device"}, "classes": {("stale-accepted-count-read", "v2")},
               "not_run": {"seed003-dflash"}},  # no DFlash in this release: nothing to run
    "0.20.0": {"skipped": {"states_v2.acc_device"}, "classes": {("stale-accepted-count-read", "v2")},
               "not_run": set()},
}


def _version() -> str:
    return real_release.vllm_version().split("+")[0]


def _v(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def _carries(version: str) -> set[str]:
    hybrid = {"kv-load-hybrid"} if _hybrid_raises(version) else set()
    hybrid |= {"kv-load-shared"} if _v(version) >= SHARED_FROM else set()
    hybrid |= ROUTER_FAULT
    hybrid |= {"kv-reown-in-flight"} if _v(version) < REOWN_FIXED_FROM else set()
    hybrid |= {"kv-prune-in-flight"} if _v(version) < PRUNE_FIXED_FROM else set()
    if tuple(int(x) for x in version.split(".")[:3]) >= FIXED_FROM:
        return set(OPEN) | hybrid
    if version not in CARRIES:
        pytest.fail(f"vLLM {version}: no entry in CARRIES; add what its sources say before testing it")
    return CARRIES[version] | OPEN | hybrid


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return real_release.run(str(tmp_path_factory.mktemp("real_release")))


def _gaps() -> dict:
    g = GAPS.get(_version(), {"skipped": set(), "classes": set(), "not_run": set()})
    if _v(_version()) < SHARED_FROM:
        g = {**g, "not_run": g["not_run"] | {"kv-load-shared"}}
    return g


def test_flagged_is_exactly_what_the_release_gets_wrong(result):
    for name, fam in result["families"].items():
        assert fam["flagged"] == fam["expected"], (name, fam)
        assert ("not_run" in fam) == (name in _gaps()["not_run"]), (name, fam)


def test_the_release_carries_the_seed_bugs_its_sources_say(result):
    carries = _carries(_version())
    for name, fam in result["families"].items():
        if "not_run" in fam:
            assert name not in carries and fam["not_run"], (name, fam)  # never a carried bug left unrun
        elif name in carries:
            assert fam["expected"], f"{name}: vLLM {_version()} carries it but no scenario hit it"
        else:
            assert fam["expected"] == [] and fam["flagged"] == [], (name, fam)


def test_doctor_records_every_class_here(result):
    """No required hook skipped on this release, and every bug class recorded under V1 (the
    runner these scenarios and every CPU host use) and recorded or not applicable under V2."""
    gaps = _gaps()
    assert set(result["doctor_skipped"]) == gaps["skipped"]
    from pdtrace.commands.doctor import _rows
    from pdtrace.commands.doctor_coverage import class_coverage

    rows, _broken = _rows()
    for c in class_coverage(rows):
        for runner, ok in (("v1", ("recorded",)), ("v2", ("recorded", "does not apply"))):
            if (c["class"], runner) in gaps["classes"]:
                assert c[runner].startswith("not checked"), (c["class"], runner, c[runner])
            else:
                assert c[runner].startswith(ok), (c["class"], runner, c[runner])


def test_lookahead_oracle_counts_shifted_blocks(result):
    """The oracle itself: a D request is shifted exactly when P reported more blocks than its
    prompt fills (its lookahead blocks: a prompt ending within k tokens of a block boundary, on a
    release that reports them; never on a release that reports only computed blocks)."""
    fam = result["families"]["seed000-lookahead"]
    if "not_run" in fam:  # asserted above: only where GAPS says the release's trim cannot run here
        return
    with open(fam["trace"].replace(".jsonl", ".cases.json")) as fh:
        cases = json.load(fh)["cases"]
    for c in cases:
        f = c["facts"]
        extra = len(f["p_reported"][0]) - -(-f["prompt_len"] // real_release.BS)
        assert c["wrong"] == (extra > 0), c


def test_entry_point_prints_one_json_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdtrace.testing.real_release", str(tmp_path), "seed004-stale"],
                          capture_output=True, text=True, timeout=600)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(last) >= {"vllm", "scenarios", "flagged", "expected", "doctor_skipped"}
    assert last["scenarios"] == 2 and proc.returncode == (0 if last["flagged"] == last["expected"] else 1)
    bad = subprocess.run([sys.executable, "-m", "pdtrace.testing.real_release", str(tmp_path), "nope"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "unknown family 'nope'" in bad.stderr


def test_the_standalone_repro_fails_exactly_where_the_release_carries_the_bug(tmp_path):
    """The tests `pdtrace repro --cause 1` writes from the bundled samples, run with this release's Python in a
    directory of their own, pdtrace off the path (the release venvs have no pdtrace: the files run with pytest and
    vLLM alone): each fails, naming the blocks, on a release that carries its bug for that situation, skips (saying
    why) where the release cannot reach it, and passes on the others. On the suites' own vLLM this test is left out
    (tests/conftest.py ONE_REPRO_RUN) where tests/test_repro_standalone.py's test_each_class is selected: that one
    runs the same written tests, holds them to the same table (tests/repro_table.py) and puts each beside its fault
    or fix."""
    from pathlib import Path

    from pdtrace.commands import repro

    root = Path(__file__).resolve().parent.parent
    v = _version()
    for sample in repro_table.REPRO:
        name = repro_table.name(sample)
        assert repro.run(str(root / sample), cause=1, output=str(tmp_path / f"test_{name}.py")) == 0
    # as a maintainer runs it: no PYTHONPATH to pdtrace, no VLLM_TARGET_DEVICE
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_TARGET_DEVICE")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:pdtrace", "-rA",
                           "."], capture_output=True, text=True, timeout=900, cwd=str(tmp_path), env=env)
    out = proc.stdout
    for sample in repro_table.REPRO:
        name = repro_table.name(sample)
        want = repro_table.expected(name, v)
        seen = [ln for ln in out.splitlines() if f"test_{name}.py" in ln and ln.split(" ")[0] in
                ("PASSED", "FAILED", "SKIPPED", "ERROR")]
        assert seen and seen[0].startswith(want), (name, want, seen, out[-3000:])
        if want == "FAILED":
            assert repro_table.REPRO_SAYS[name] in out, (name, out[-3000:])
