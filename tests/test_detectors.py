"""Detector unit tests over hand-built event lists (tests/eventlib.py).

Each scenario is built twice from the same situation: with the old (buggy) vLLM rule and
with the upstream fix. Buggy -> the exact finding (kind, request, block ids / values);
fixed -> no finding. A corpus test walks sample_traces/ and tests/corpus/ (traces with
``<name>.expected.json`` sidecars) and scores precision / recall.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import eventlib as E  # noqa: E402

from pdtrace.detectors import whatif  # noqa: E402
from pdtrace.detectors import (  # noqa: E402
    ALL_KINDS,
    DETECTORS,
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION,
    LOOKAHEAD_MISALIGNMENT,
    METADATA_CLEARED_BEFORE_DRAFTER,
    STALE_ACCEPTED_COUNT_READ,
    run_all,
)


def _only(events, kind):
    return [f for f in run_all(events) if f.kind == kind]


# ---------------------------------------------------------------- lookahead misalignment

@pytest.mark.parametrize("prompt_len,lookahead,extra", [
    (16, 1, 1),   # block-aligned prompt: the lookahead slot spills into one extra block
    (32, 17, 2),  # two trailing lookahead blocks
    (48, 16, 1),
])
def test_lookahead_buggy_aligned_shifts_mapping(prompt_len, lookahead, extra):
    b = E.lookahead_scenario(prompt_len=prompt_len, lookahead=lookahead, p_first_block=10, d_first_block=50)
    fs = _only(b.events, LOOKAHEAD_MISALIGNMENT)
    assert len(fs) == 1
    f = fs[0]
    assert (f.kind, f.severity, f.req, f.inst) == (LOOKAHEAD_MISALIGNMENT, "error", "r1", "D")
    g = f.data["groups"][0]
    needed = prompt_len // 16
    p_blocks = list(range(10, 10 + needed + extra))
    assert g["reported"] == p_blocks
    assert g["extra_blocks"] == p_blocks[needed:]
    assert g["shift"] == extra
    # every D block i (tokens 16i..16i+15) got P block i+extra instead of P block i
    assert [(p["local"], p["remote"], p["expected"], p["tokens"]) for p in g["pairs"]] == [
        (50 + i, 10 + i + extra, 10 + i, [16 * i, 16 * i + 16]) for i in range(needed)]
    assert "50" in f.explanation and str(10 + extra) in f.explanation
    ids = {e["ev"]: e["id"] for e in b.events}
    assert {ids["nixl.request_finished"], ids["nixl.remote_alloc"], ids["nixl.trim"], ids["nixl.read"]} <= set(f.event_ids)


@pytest.mark.parametrize("prompt_len,lookahead", [(16, 1), (32, 17), (30, 1), (33, 3)])
def test_lookahead_fixed_rule_no_finding(prompt_len, lookahead):
    b = E.lookahead_scenario(prompt_len=prompt_len, lookahead=lookahead, fixed=True)
    assert _only(b.events, LOOKAHEAD_MISALIGNMENT) == []


@pytest.mark.parametrize("prompt_len", [30, 33, 17])
def test_lookahead_non_aligned_zero_trailing_blocks(prompt_len):
    # lookahead fits in the last partial block: P reports exactly the needed blocks
    b = E.lookahead_scenario(prompt_len=prompt_len, lookahead=1)
    assert _only(b.events, LOOKAHEAD_MISALIGNMENT) == []


def test_lookahead_latent_when_no_d_side():
    b = E.lookahead_scenario(prompt_len=32, lookahead=1, d_side=False, p_first_block=7)
    (f,) = _only(b.events, LOOKAHEAD_MISALIGNMENT)
    assert f.severity == "warning" and f.req == "r1" and f.inst == "P"
    assert f.data["groups"][0]["extra_blocks"] == [9]
    assert f.data["mapping_source"] == "none"


def test_lookahead_latent_when_d_mapping_right():
    # D allocated as many blocks as P reported (no trim needed): extra block present but harmless
    b = E.EventBuilder()
    b.config("P")
    b.config("D", lookahead=0)
    b.add("nixl.request_finished", inst="P", req="x", step=2, side="P", allocated_block_ids=[[1, 2]],
          arg_block_ids=[[1, 2]], block_ids=[[1, 2]], remote_num_tokens=16, num_computed_tokens=16,
          prompt_len=16, delay_free=True)
    b.add("nixl.remote_alloc", inst="D", req="x", step=3, local_block_ids=[[8, 9]], remote_block_ids=[[1, 2]],
          remote_num_tokens=16, num_external_tokens=16, remote_req="x")
    b.add("nixl.read", inst="D", req="x", step=3, local_block_ids=[[8, 9]], remote_block_ids=[[1, 2]], bytes=0,
          handle="h")
    (f,) = _only(b.events, LOOKAHEAD_MISALIGNMENT)
    assert f.severity == "warning"
    assert [p["ok"] for p in f.data["groups"][0]["pairs"]] == [True, True]


def test_lookahead_d_prefix_cache_hit_fixed_is_clean_buggy_shifts():
    # D already has the first block cached: it loads the suffix only; end-trim is right iff P clipped
    fixed = E.lookahead_scenario(prompt_len=48, lookahead=1, d_cached_blocks=1, fixed=True)
    assert _only(fixed.events, LOOKAHEAD_MISALIGNMENT) == []
    buggy = E.lookahead_scenario(prompt_len=48, lookahead=1, d_cached_blocks=1, p_first_block=10, d_first_block=50)
    (f,) = _only(buggy.events, LOOKAHEAD_MISALIGNMENT)
    pairs = [(p["local"], p["remote"], p["expected"]) for p in f.data["groups"][0]["pairs"]]
    assert pairs == [(50, 12, 11), (51, 13, 12)]


def test_lookahead_hybrid_mamba_and_per_group_block_size():
    # group 0: attention B=16 (aligned -> extra block), group 1: attention B=64 (33 tokens fit: no extra),
    # group 2: Mamba state group (never clipped, never flagged)
    kinds = ("FullAttentionSpec", "SlidingWindowSpec", "MambaSpec")
    b = E.lookahead_scenario(prompt_len=32, lookahead=1, block_sizes=(16, 64, 1), group_kinds=kinds,
                             p_first_block=10, d_first_block=50)
    (f,) = _only(b.events, LOOKAHEAD_MISALIGNMENT)
    g0, g1, g2 = f.data["groups"]
    assert g0["mismatches"] == 2 and g0["shift"] == 1 and g0["extra_blocks"] == [12]
    assert g1["mismatches"] == 0 and g1["extra_blocks"] == [] and g1["blocks_needed"] == 1
    assert g2["state_group"] and g2["mismatches"] == 0 and g2["pairs"] == []
    fixed = E.lookahead_scenario(prompt_len=32, lookahead=1, block_sizes=(16, 64, 1), group_kinds=kinds, fixed=True)
    assert _only(fixed.events, LOOKAHEAD_MISALIGNMENT) == []


def test_lookahead_inferred_from_remote_alloc_only_and_distinct_d_request_id():
    b = E.lookahead_scenario(prompt_len=16, lookahead=1, trim=False, read=False, d_req="d-r1",
                             p_first_block=10, d_first_block=50)
    (f,) = _only(b.events, LOOKAHEAD_MISALIGNMENT)
    assert f.data["mapping_source"] == "inferred"
    assert f.data["d_req"] == "d-r1" and f.req == "r1"
    assert [x.req for x in run_all(b.events, request="d-r1")] == ["r1"]  # --request matches either side's id


def test_whatif_fixed_trim_shows_recorded_vs_fixed():
    b = E.lookahead_scenario(prompt_len=32, lookahead=1, p_first_block=10, d_first_block=50,
                             block_sizes=(16, 1), group_kinds=("FullAttentionSpec", "MambaSpec"))
    (r,) = whatif.fixed_trim(b.events)
    g0, g1 = r["groups"]
    assert g0["recorded"] == [[50, 11], [51, 12]]
    assert g0["fixed"] == [[50, 10], [51, 11]]
    assert g0["clipped"] == [10, 11] and g0["changed"]
    assert g1["state_group"] and g1["fixed"] == g1["recorded"]
    assert "50<-10" in whatif.render_text([r])
    fixed = E.lookahead_scenario(prompt_len=30, lookahead=1)
    assert whatif.fixed_trim(fixed.events) == []


# ---------------------------------------------------------------- metadata cleared before drafter

def test_metadata_buggy_clear_before_drafter():
    b = E.metadata_scenario(fixed=False, step=7, drafter_layers=("d.0.attn", "d.1.attn"))
    (f,) = _only(b.events, METADATA_CLEARED_BEFORE_DRAFTER)
    clear = next(e for e in b.events if e["ev"] == "kvmeta.clear")
    assert (f.severity, f.step, f.inst, f.req) == ("error", 7, "P", "r1")
    assert f.data["clear_event"] == clear["id"] and clear["id"] in f.event_ids
    assert f.data["drafter_layers_not_saved"] == ["d.0.attn", "d.1.attn"]
    assert len(f.data["has_false_events"]) == 2


def test_metadata_fixed_clear_after_drafter():
    assert _only(E.metadata_scenario(fixed=True).events, METADATA_CLEARED_BEFORE_DRAFTER) == []


def test_metadata_decode_instance_not_flagged():
    # D does not save KV: the early clear loses nothing
    assert _only(E.metadata_scenario(fixed=False, inst="D").events, METADATA_CLEARED_BEFORE_DRAFTER) == []


def test_metadata_tp_ranks_fold_and_steps_separate():
    b = E.EventBuilder()
    for step in (1, 2):
        for rank in (0, 1):
            E.metadata_scenario(b, fixed=(step == 2), step=step, rank=rank)
    (f,) = _only(b.events, METADATA_CLEARED_BEFORE_DRAFTER)
    assert f.step == 1 and f.data["ranks"] == [0, 1]


def test_metadata_nothing_to_save_is_warning():
    b = E.metadata_scenario(fixed=False, inst="PD", n_save=0)
    (f,) = _only(b.events, METADATA_CLEARED_BEFORE_DRAFTER)
    assert f.severity == "warning"
    # (issue 49) the words agree with themselves: what the metadata named, how many of them to save, and that
    # nothing was lost at this step; the empty phase in the viewer's words
    assert "0 request(s) to save [" not in f.explanation and "nothing was to be saved" in f.explanation.lower()
    assert "phase ''" not in f.explanation and "between the model phases" in f.explanation


# ---------------------------------------------------------------- drafter window

def test_window_buggy_names_positions_and_shared_block():
    b = E.window_scenario(fixed=False, prompt_len=16, num_spec_tokens=3)
    (f,) = _only(b.events, DRAFTER_WINDOW_OUTSIDE_ALLOCATION)
    assert (f.severity, f.req, f.step) == ("error", "new", 3)
    assert f.data["block_ids"] == [30] and f.data["capacity"] == 16
    assert f.data["outside_positions"] == [16, 17, 18, 19]
    (blk,) = f.data["blocks"]
    assert blk["block_index"] == 1 and blk["stale_block"] == 6 and blk["stale_from_req"] == "old"
    assert blk["held_by"] == ["a", "b"] and blk["shared"]


def test_window_fixed_reserves_lookahead():
    assert _only(E.window_scenario(fixed=True).events, DRAFTER_WINDOW_OUTSIDE_ALLOCATION) == []


def test_window_non_aligned_prompt_fits_in_last_block():
    # 12 prompt tokens + 4 window positions = 16 <= one block: nothing outside even without lookahead
    assert _only(E.window_scenario(fixed=False, prompt_len=12).events, DRAFTER_WINDOW_OUTSIDE_ALLOCATION) == []


# ---------------------------------------------------------------- stale accepted count

def test_stale_read_sync_no_moves_clean():
    assert _only(E.stale_read_scenario().events, STALE_ACCEPTED_COUNT_READ) == []


@pytest.mark.parametrize("move,req,row,value,truth,other", [
    ("swap", "r1", 1, 4, 1, "r2"),
    ("condense", "r3", 1, 4, 2, "r2"),
])
def test_stale_read_row_moved_is_error(move, req, row, value, truth, other):
    b = E.stale_read_scenario(move=move)
    (f,) = _only(b.events, STALE_ACCEPTED_COUNT_READ)
    assert (f.severity, f.req, f.data["row"], f.data["value"], f.data["truth"]) == ("error", req, row, value, truth)
    assert f.data["row_req_at_issue"] == other and "row-moved" in f.data["reasons"]
    assert f.data["row_history"], "the row moves between issue and read are reported"


@pytest.mark.parametrize("move", ["swap", "condense"])
def test_stale_read_fixed_uses_issue_row(move):
    assert _only(E.stale_read_scenario(move=move, fixed=True).events, STALE_ACCEPTED_COUNT_READ) == []


def test_stale_read_copy_not_complete_right_value_is_warning():
    b = E.stale_read_scenario(event_done=False)
    (f,) = _only(b.events, STALE_ACCEPTED_COUNT_READ)
    assert f.severity == "warning" and f.data["reasons"] == ["copy-not-complete"]
    assert f.data["value"] == f.data["truth"] == 1


def test_stale_read_copy_not_complete_wrong_value_is_error():
    b = E.stale_read_scenario(event_done=False)
    read = next(e for e in b.events if e["ev"] == "acc.read")
    read["value"] = 3  # the CPU buffer still held last step's count
    (f,) = _only(b.events, STALE_ACCEPTED_COUNT_READ)
    assert f.severity == "error" and (f.data["value"], f.data["truth"]) == (3, 1)


def test_stale_read_synced_is_clean():
    assert _only(E.stale_read_scenario(event_done=False, synced=True).events, STALE_ACCEPTED_COUNT_READ) == []


# ---------------------------------------------------------------- run_all

def test_run_all_sorted_filters_and_validates():
    b = E.EventBuilder()
    E.lookahead_scenario(b, prompt_len=16, step=3)
    E.metadata_scenario(b, step=1)
    E.stale_read_scenario(b, move="swap", step=9)
    fs = run_all(b.events)
    assert [f.kind for f in fs] == [METADATA_CLEARED_BEFORE_DRAFTER, LOOKAHEAD_MISALIGNMENT, STALE_ACCEPTED_COUNT_READ]
    assert [f.kind for f in run_all(b.events, only=[STALE_ACCEPTED_COUNT_READ])] == [STALE_ACCEPTED_COUNT_READ]
    with pytest.raises(ValueError):
        run_all(b.events, only=["bogus"])
    assert set(DETECTORS) == set(ALL_KINDS)
    for f in fs:
        assert f.title and f.explanation and f.event_ids and f.severity in ("error", "warning")


# ---------------------------------------------------------------- corpus: precision / recall

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS_DIRS = [ROOT / "sample_traces"]  # labelled traces with .expected.json sidecars


def _corpus(d: pathlib.Path) -> list[pathlib.Path]:
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.jsonl") if p.with_name(p.stem + ".expected.json").exists())


@pytest.mark.parametrize("directory", CORPUS_DIRS, ids=lambda p: p.name)
def test_corpus_precision_recall(directory):
    from pdtrace.tracefile.trace import load

    traces = _corpus(directory)
    assert traces, f"no traces with .expected.json sidecars in {directory}"
    tp = fp = fn = 0
    misses = []
    for path in traces:
        expected = json.loads(path.with_name(path.stem + ".expected.json").read_text())["findings"]
        tr = load(str(path))
        got = sorted({f.kind for f in run_all(tr.events, tr.header)})
        want = sorted(set(expected))
        tp += len(set(got) & set(want))
        fp += len(set(got) - set(want))
        fn += len(set(want) - set(got))
        if got != want:
            misses.append(f"{path.name}: expected {want}, got {got}")
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    print(f"{directory.name}: {len(traces)} traces, precision {precision:.2f}, recall {recall:.2f}")
    assert precision == 1.0 and recall == 1.0, "\n".join(misses)


# ---------------------------------------------------------------- the loader's shortcuts change nothing

def _gen_trace(path: pathlib.Path, n: int, seed: int) -> pathlib.Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_trace", ROOT / "bench" / "gen_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.generate(str(path), n, seed=seed, inject_bugs=True)
    return path


def _rewrite(src: pathlib.Path, dst: pathlib.Path, *, id_offset: int = 0, drop_running_blocks: bool = False):
    """A copy of a trace with other ids (still increasing) and / or schema v2 allocs (a
    running request's sched.alloc without block_ids)."""
    held = set()
    out = []
    for raw in src.read_bytes().splitlines():
        e = json.loads(raw)
        if "id" in e and e["ev"] not in ("trace.header", "trace.footer"):
            e["id"] += id_offset
        if drop_running_blocks and e["ev"] == "sched.alloc":
            key = (e["pid"], e["inst"], e["req"])
            if key in held:
                del e["block_ids"]
            held.add(key)
        out.append(json.dumps(e))
    dst.write_text("\n".join(out) + "\n")
    return dst


@pytest.mark.parametrize("seed", [0, 1])
def test_findings_same_from_loaded_and_plain_lists(tmp_path, seed):
    """trace.load's extras (kind groups, kind codes, aligned ids, derived blocks) are
    shortcuts only: a plain list of the same events, a trace whose ids are not positions,
    and a schema v2 trace whose allocations are derived all give the same findings."""
    import copy

    from pdtrace.tracefile.trace import load

    def dump(fs):
        return [f.to_dict() for f in fs]

    base = _gen_trace(tmp_path / "g.jsonl", 12_000, seed)
    tr = load(str(base))
    got = dump(run_all(tr.events, tr.header))
    assert {f["kind"] for f in got} == set(ALL_KINDS)
    assert dump(run_all(copy.deepcopy(list(tr.events)), tr.header)) == got
    for kind, fn in DETECTORS.items():  # each detector on its own, loaded vs plain
        assert dump(fn(tr.events, tr.header)) == dump(fn(copy.deepcopy(list(tr.events)), tr.header)), kind

    shifted = load(str(_rewrite(base, tmp_path / "s.jsonl", id_offset=1000)))
    assert not shifted.events.ids_aligned
    got_shifted = dump(run_all(shifted.events, shifted.header))
    assert got_shifted == dump(run_all(copy.deepcopy(list(shifted.events)), shifted.header))
    assert [f["event_ids"] for f in got_shifted] == [[i + 1000 for i in f["event_ids"]] for f in got]

    v2 = load(str(_rewrite(base, tmp_path / "v2.jsonl", drop_running_blocks=True)))
    assert sum(1 for e in v2.events if e.get("block_ids_derived")) > 100
    strip = [{k: v for k, v in e.items() if k != "block_ids_derived"} for e in v2.events]
    assert strip == [dict(e) for e in tr.events]  # the derived lists are the original ones
    assert dump(run_all(v2.events, v2.header)) == got


def test_local_over_remote_without_a_token_count_is_worded_as_what_happened():
    """D holds more blocks to load than P reported and nothing gives P's token count: no trim
    happens there (vLLM asserts, #50558), so the inconclusive finding does not say 'end-trims'."""
    b = E.lookahead_scenario(prompt_len=32, lookahead=0, trim=False, read=False, p_first_block=10, d_first_block=50)
    for e in b.events:
        if e["ev"] == "nixl.remote_alloc":
            e["local_block_ids"] = [e["local_block_ids"][0] + [99]]  # one block more than P reported
            e.pop("remote_num_tokens", None)
    b.events = [e for e in b.events if e["ev"] != "nixl.request_finished"]
    (f,) = _only(b.events, LOOKAHEAD_MISALIGNMENT)
    assert f.severity == "inconclusive" and "local > remote" in f.title and "end-trims" not in f.title
    assert "asserts" in f.explanation
