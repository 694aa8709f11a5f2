"""Seed 000 (vLLM #44151: P hands D its spec-decode lookahead blocks, D end-trims) recorded live on an H100, on the
release that carries it (vLLM 0.24.0) and on 0.32.0 (the fix since 0.25.0), under the same load.

Real parts: the whole run was real (vLLM's CUDA wheels, P/D over NIXL/UCX with GPU KV buffers, EAGLE k=3, block
size 16, model runner V2, 128 distinct prompts of every residue of the block size; provenance in
sample_traces/README.md and docs/live-gpu.md). No GPU runs here: these tests read the recorded files. The oracles
are not the detectors: the tokens each request got disaggregated against those P decoded locally
(sample_traces/live_gpu_seed000_tokens.json), vLLM's own block lists as recorded (scripts/boundary_oracle.py
pairs each D block with P's block by position), and the prompt lengths alone.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import boundary_oracle  # noqa: E402

TOKENS = ROOT / "sample_traces" / "live_gpu_seed000_tokens.json"
TRACE = {run: ROOT / "sample_traces" / f"live_gpu_seed000_{run}.jsonl.zst" for run in ("v024", "v032")}


def _judge(run: str) -> dict:
    reqs = json.loads(TOKENS.read_text())["runs"][run]["requests"]
    return boundary_oracle.judge(reqs, boundary_oracle.events(str(TRACE[run])),
                                 boundary_oracle.fresh_check(str(TRACE[run])))


@pytest.fixture(scope="module")
def bug():
    return _judge("v024")


def test_on_0_24_0_every_wrong_mapping_is_one_error_with_its_shift_and_nothing_else(bug):
    t = bug["table"]
    assert t["requests"] == t["served"] == 128 and t["mapping_unknown"] == 0
    assert t["mapping_wrong"] == t["flagged"] == 24 and t["false"] == t["missed"] == 0
    # (the KV invariant, no rule for this bug, flags the same 24 D requests: tests/test_kv_invariant.py)
    assert t["errors_by_kind"] == {"lookahead-block-misalignment": 24, "kv-invariant": 24}
    rows = [r for r in bug["rows"] if r["flagged"]]
    assert all(r["flag_shifts"] == r["oracle_shifts"] == [1] for r in rows)


def test_on_0_24_0_every_request_whose_tokens_diverge_is_flagged(bug):
    t = bug["table"]
    assert t["diverged"] == 19 and t["diverged_not_flagged"] == 0 and t["diverged_right_mapping"] == 0
    # a wrong mapping need not change a greedy token of a tiny random model: 5 kept their tokens and are still
    # errors, since D read KV P never wrote (the mapping oracle says so, not the tokens)
    assert sum(r["mapping_wrong"] and not r["diverged"] for r in bug["rows"]) == 5


def test_the_wrong_mappings_are_the_prompts_whose_lookahead_spills_a_block(bug):
    """From the prompt lengths alone: P allocates cdiv(len + 3, 16) blocks (EAGLE, 3 lookahead slots), D needs
    cdiv(len, 16); they differ exactly when len mod 16 is 0, 14 or 15."""
    spill = {r["name"] for r in bug["rows"] if -(-(r["len"] + 3) // 16) > -(-r["len"] // 16)}
    assert {r["name"] for r in bug["rows"] if r["flagged"]} == spill
    assert {int(n.split("len")[1]) % 16 for n in spill} == {0, 14, 15}


def test_on_0_32_0_the_same_load_diverges_nowhere_and_gives_no_finding():
    t = _judge("v032")["table"]
    assert t["requests"] == t["served"] == 128 and t["mapping_unknown"] == 0
    assert t["mapping_wrong"] == t["diverged"] == t["flagged"] == 0 and t["errors_by_kind"] == {}


def test_boundary_oracle_cli_exit_codes(tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "boundary_oracle.py"), *a],
                              capture_output=True, text=True, timeout=300)

    ok = run("--tokens", str(TOKENS), "--run", "v024", "--trace", str(TRACE["v024"]))
    assert ok.returncode == 0 and "| 128 | 24 | 19 | 24 | 0 | 0 | 0 |" in ok.stdout, ok.stderr
    missing = run(str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "result.json" in missing.stderr
    # the tokens of the other run held to this trace: refused, not a table of zeros (a new user's pass)
    other = run("--tokens", str(TOKENS), "--run", "v032", "--trace", str(TRACE["v024"]))
    assert other.returncode == 2 and other.stdout == "" and "not this trace's run" in other.stderr
    unknown = run("--tokens", str(TOKENS), "--run", "v999", "--trace", str(TRACE["v024"]))
    assert unknown.returncode == 2 and "its runs: v024, v032" in unknown.stderr and "Error" not in unknown.stderr


def test_the_report_draws_no_drafter_window_outside_its_allocation():
    """0.24.0's V2 runner drafts for its warm-up requests (`_warmup_0_` ..., 16 windows on P and D) which the
    scheduler never allocated: the report's window figure drew them as writing past an allocation of 0 slots on a
    run whose every window the detector holds inside its blocks. Unknown is not outside."""
    from pdtrace.viewers.html.common import Model
    from pdtrace.viewers.html.fig_windows import windows

    ev = boundary_oracle.events(str(TRACE["v024"]))
    assert sum(e["ev"] == "spec.window" and e.get("req", "").startswith("_warmup") for e in ev) == 16
    fig, note = windows(Model(ev, []), 40)
    assert fig is None and note == ("4239 drafter write window(s) in the trace (16 with no allocation recorded, not "
                                    "judged: a model runner's warm-up has none); none writes past the request's blocks")


def test_the_viewer_does_not_call_a_warm_up_window_outside(tmp_path):
    """The viewer's window pane, on the same warm-up requests: no allocation recorded is said, not drawn red."""
    import shutil

    from rich.console import Console

    from pdtrace.index.trace_index import TraceIndex
    from pdtrace.viewers.tui import drafter
    from pdtrace.viewers.tui.widgets.window import WindowPane

    trace = tmp_path / TRACE["v024"].name
    shutil.copy(TRACE["v024"], trace)
    ws = drafter.windows(TraceIndex(str(trace)).build(), ["_warmup_0_"], [])
    assert len(ws) == 4 and all(w.alloc_id is None and not w.outside for w in ws)  # P and D, 2 each
    console = Console(width=100, record=True)
    console.print(WindowPane().build(100, ws, "_warmup_0_", None, []))
    text = console.export_text()
    assert "no allocation recorded: not judged" in text and "OUTSIDE" not in text
    # a request of the load is held to its allocation as before
    req = next(e["req"] for e in boundary_oracle.events(str(TRACE["v024"])) if e["ev"] == "spec.window"
               and not e["req"].startswith("_warmup"))
    ws = drafter.windows(TraceIndex(str(trace)).build(), [req], [])
    assert ws and all(w.alloc_id is not None and not w.outside for w in ws)


def test_the_first_screen_names_the_block():
    """One bug, one screen: at 80x24 `check`'s first screen names the cause, the first request and step, and the
    block D read instead of the right one (the first finding's own words)."""
    r = subprocess.run([sys.executable, "-m", "pdtrace", "check", str(TRACE["v024"])], capture_output=True, text=True,
                       env={**__import__("os").environ, "COLUMNS": "80"}, timeout=300)
    assert r.returncode == 1
    screen = " ".join(ln.strip() for ln in r.stdout.splitlines()[:24])
    assert "1 root cause" in screen and "#44151" not in screen and "issues/44151" in screen
    assert "step 44: D block 2 read P block 3 instead of 2 (group 0, shift +1)" in screen


def test_the_report_names_both_ids_of_each_block_map_and_links_no_block_position(tmp_path):
    """A finding names P's request, a block map is D's: each block map's heading names both, so a finding's id is
    found on the page; 'local #0' in a finding's text is a block position, not trace event 0."""
    import re

    out = tmp_path / "r.html"
    r = subprocess.run([sys.executable, "-m", "pdtrace", "report", str(TRACE["v024"]), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    heads = re.findall(r'<h3 id="req-[^"]*">D (\S+) ← P (\S+)</h3>', page)
    assert len(heads) == 12  # the page draws 12 of the 24
    flagged = {f["req"] for f in boundary_oracle.fresh_check(str(TRACE["v024"]))["findings"]}
    assert {p for _d, p in heads} <= flagged
    assert 'local #<a class="evlink"' not in page and "local #0" in page
