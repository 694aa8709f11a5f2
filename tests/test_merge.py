"""`pdtrace merge`: P and D traces from two hosts, clocks aligned on the KV hand-over."""

import subprocess
import sys

from pdtrace.merge import fit_clock, merge_traces
from pdtrace.tracefile.trace import load, make_header, write_trace

B = 1_000_000  # 1 ms in ns


def ev(kind, w, inst, **kw):
    return {"ev": kind, "t": w, "w": w, "pid": 1 if inst == "P" else 2, "role": "engine-core", "inst": inst, **kw}


def pd_traces(d_skew):
    """P finishes r1 at 10 ms; D learns of it 2 ms later and reads it; P frees at 20 ms.
    D's wall clock runs ``d_skew`` ns behind P's."""
    p = [ev("nixl.request_finished", 10 * B, "P", req="r1", side="P", allocated_block_ids=[[1, 2]],
            arg_block_ids=[[1]], block_ids=[[1]], remote_num_tokens=16, num_computed_tokens=16, prompt_len=16,
            delay_free=True),
         ev("nixl.send_done", 20 * B, "P", req="r1")]
    d = [ev("nixl.remote_alloc", 12 * B - d_skew, "D", req="d1", local_block_ids=[[7]], remote_block_ids=[[1]],
            num_external_tokens=16, remote_req="r1"),
         ev("nixl.read", 13 * B - d_skew, "D", req="d1", local_block_ids=[[7]], remote_block_ids=[[1]], bytes=0,
            handle="h", remote_req="r1")]
    return p, d


def test_consistent_clocks_are_left_alone():
    p, d = pd_traces(0)
    fit = fit_clock(p, d)
    assert fit.offset_ns == 0 and fit.pairs == 2
    assert (fit.lower_ns, fit.upper_ns) == (-2 * B, 7 * B)
    assert fit.residual_ns == 4500 * 1000


def test_skewed_clock_is_shifted_to_restore_causality():
    p, d = pd_traces(50 * B)  # D's clock 50 ms behind: D seems to learn of r1 before P finished it
    fit = fit_clock(p, d)
    assert fit.offset_ns == 48 * B  # smallest shift that puts D's learning after P's finish
    assert fit.lower_ns == 48 * B and fit.upper_ns == 57 * B
    # symmetric: D given first
    fit2 = fit_clock(d, p)
    assert fit2.offset_ns == -48 * B


def test_merge_cli_orders_by_aligned_time(tmp_path):
    p, d = pd_traces(50 * B)
    write_trace(str(tmp_path / "P.jsonl"), make_header(origin="record", versions={}), p)
    write_trace(str(tmp_path / "D.jsonl"), make_header(origin="record", versions={}), d)
    out = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "pdtrace", "merge", str(tmp_path / "P.jsonl"),
                        str(tmp_path / "D.jsonl"), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "residual skew" in r.stderr and "offset 48.000 ms" in r.stderr
    tr = load(str(out))
    assert [e["ev"] for e in tr.events] == ["nixl.request_finished", "nixl.remote_alloc", "nixl.read", "nixl.send_done"]
    assert tr.header["origin"] == "merge" and tr.header["instances"] == ["D", "P"]
    assert tr.header["clock"]["traces"][0]["offset_ns"] == 48 * B
