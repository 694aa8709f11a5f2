"""`pdtrace merge` in bounded memory (pdtrace/merge.py, issue 22) against the in-memory merge it
replaced (every input loaded whole, its wall times shifted, stably sorted by wall time,
heap-merged; written here as the reference).

Inputs are the live P/D samples (real vLLM 0.32 + NIXL on an H100 and on CPU) split back into
their P and D traces, with D's wall clock skewed, and with events a little out of wall-clock
order (as a recording is: each process writes in monotonic order); merged with segments of a
few events so that every segment boundary and the reorder buffer are crossed."""

from __future__ import annotations

import heapq
import random
from pathlib import Path

import orjson
import pytest

from pdtrace import merge as join
from pdtrace.merge import fit_clock, merge_traces
from pdtrace.tracefile.trace import load, make_header, write_trace

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def _in_memory(paths, lenient=False):
    """The merge as it was (pdtrace 0.1.0 before the streamed one): events and clock notes."""
    loaded = [load(str(p), lenient=lenient) for p in paths]
    streams = [[dict(e) for e in loaded[0].events]]
    offs = []
    for tr in loaded[1:]:
        evs = [dict(e) for e in tr.events]
        fit = fit_clock(streams[0], evs)
        offs.append(fit.offset_ns)
        for e in evs:
            e["w"] += fit.offset_ns
        streams.append(evs)
    for s in streams:
        s.sort(key=lambda e: e["w"])
    out = list(heapq.merge(*streams, key=lambda e: e["w"]))
    for e in out:
        e.pop("id", None)
        e.pop("block_ids_derived", None) and e.pop("block_ids", None)
    return out, offs


def _lines(path):
    tr = load(str(path))
    out = []
    for e in tr.events:
        e = dict(e)
        e.pop("id", None)
        e.pop("block_ids_derived", None) and e.pop("block_ids", None)
        out.append(e)
    return tr, out


def _split(sample: str, tmp: Path, skew_ns: int, jitter_ns: int, seed: int = 0):
    tr = load(str(SAMPLES / sample))
    rnd = random.Random(seed)
    paths = []
    for inst, skew in (("P", 0), ("D", -skew_ns)):
        evs = []
        for e in tr.events:
            if e.get("inst") != inst:
                continue
            e = {k: v for k, v in e.items() if k not in ("id", "block_ids_derived")}
            e["w"] += skew + rnd.randrange(jitter_ns + 1)
            evs.append(e)
        p = tmp / f"{inst}.jsonl"
        write_trace(str(p), make_header(origin="record", cmd=[inst], versions=tr.header.get("versions")), evs)
        paths.append(p)
    return paths


@pytest.mark.parametrize("sample", ["live_gpu_pd_eagle_v1.jsonl.zst", "live_gpu_pd_eagle_v2.jsonl.zst",
                                    "live_cpu_pd_eagle.jsonl"])
@pytest.mark.parametrize("skew_ms,jitter_us", [(0, 0), (40, 300)])
def test_streamed_merge_is_the_in_memory_merge(sample, skew_ms, jitter_us, tmp_path, monkeypatch):
    paths = _split(sample, tmp_path, skew_ms * 1_000_000, jitter_us * 1000)
    want, offs = _in_memory(paths)
    monkeypatch.setattr(join, "SEGMENT", 7)
    res = merge_traces([str(p) for p in paths], str(tmp_path / "m.jsonl"))
    tr, got = _lines(tmp_path / "m.jsonl")
    assert got == want and res["events"] == len(want)
    assert [t["offset_ns"] for t in tr.header["clock"]["traces"]] == offs
    if skew_ms:
        assert offs[0] > 0  # the skew was found and undone
    assert tr.footer["events"] == len(want) and tr.footer.get("digest")
    # D given first: D is the reference, P's clock is shifted the other way
    back, offs_back = _in_memory(list(reversed(paths)))
    merge_traces([str(p) for p in reversed(paths)], str(tmp_path / "r.jsonl"))
    assert _lines(tmp_path / "r.jsonl")[1] == back and offs_back == [-o for o in offs]
    assert sorted(orjson.dumps({**e, "w": 0}) for e in back) == sorted(orjson.dumps({**e, "w": 0}) for e in want)


def test_a_damaged_input_is_merged_leniently_with_its_problems(tmp_path, monkeypatch):
    p, d = _split("live_cpu_pd_eagle.jsonl", tmp_path, 0, 0)
    raw = d.read_bytes().split(b"\n")
    raw[5] = raw[5][:20]  # a corrupt line in the middle
    d.write_bytes(b"\n".join(raw[:-3]) + b"\n")  # and no footer
    want, _offs = _in_memory([p, d], lenient=True)
    monkeypatch.setattr(join, "SEGMENT", 5)
    res = merge_traces([str(p), str(d)], str(tmp_path / "m.jsonl"), lenient=True)
    tr, got = _lines(tmp_path / "m.jsonl")
    assert got == want
    assert [pr.line for pr in res["problems"]] == [6, len(raw) - 2]
    assert tr.footer["input_problems"] and len(tr.footer["input_problems"]) == 2
    with pytest.raises(Exception, match=r"D.jsonl:6: corrupt line"):
        merge_traces([str(p), str(d)], str(tmp_path / "strict.jsonl"))


def test_the_reorder_buffer_holds_only_the_late_window(tmp_path):
    """What pass 2 holds at once is one segment per input and the reorder buffer, which
    releases an event as soon as one more than the measured lateness newer has come: with
    jitter of at most 0.2 ms, the buffer never holds events more than 0.2 ms apart."""
    _p, d = _split("live_gpu_pd_eagle_v1.jsonl.zst", tmp_path, 0, 200_000)
    inp = join._first_pass(str(d), False, None)
    assert 0 < inp.late <= 200_000
    src = list(join._shifted(inp, 0, False, None))
    widest = 0
    buffered: list[int] = []

    def watched():
        for e in src:
            buffered.append(e["w"])
            yield e
    out = []
    for e in join.in_time_order(watched(), inp.late, key="w"):
        buffered.remove(e["w"])
        if buffered:
            widest = max(widest, max(buffered) - min(buffered))
        out.append(e["w"])
    assert out == sorted(e["w"] for e in src)
    assert widest <= 2 * inp.late + max(b - a for a, b in zip(out, out[1:]))


def _cli(*args):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pdtrace", *map(str, args)], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def test_a_merge_of_damaged_inputs_is_not_a_complete_trace(tmp_path):
    """From a new-user pass: `merge --lenient` of cut inputs wrote a trace whose footer listed
    the input problems, but `check` called every class checked (exit 0) and `info` said
    complete. The lost events make the merged trace incomplete as the inputs were; the
    warnings and the footer name the input each problem line is in."""
    p, d = _split("live_cpu_pd_eagle.jsonl", tmp_path, 0, 0)
    raw = d.read_bytes().split(b"\n")
    d.write_bytes(b"\n".join(raw[:-3]) + b"\n")  # D without its footer (and its last event)
    out = tmp_path / "m.jsonl"
    rc, _o, err = _cli("merge", p, d, "-o", out, "--lenient")
    assert rc == 0 and f"warning: D.jsonl:{len(raw) - 2}: no footer" in err, err
    (only,) = load(str(out)).footer["input_problems"]
    assert only.startswith(f"D.jsonl:{len(raw) - 2}: no footer")
    rc, text, _e = _cli("check", out)
    assert rc == 4 and "INCOMPLETE: merged from damaged input(s)" in text, text
    assert "  checked" not in text
    rc, text, _e = _cli("info", out)
    assert rc == 0 and "complete   NO: merged from damaged input(s)" in text, text


def test_merge_refuses_the_same_recording_twice_and_its_own_input_as_output(tmp_path):
    p, d = _split("live_cpu_pd_eagle.jsonl", tmp_path, 0, 0)
    copy = tmp_path / "P-copy.jsonl"
    copy.write_bytes(p.read_bytes())
    rc, _o, err = _cli("merge", p, copy, "-o", tmp_path / "m.jsonl")
    assert rc == 2 and "hold the same process" in err and err.count("\n") == 1, err
    assert not (tmp_path / "m.jsonl").exists()
    before = p.read_bytes()
    rc, _o, err = _cli("merge", p, d, "-o", p)
    assert rc == 2 and "is also an input" in err and p.read_bytes() == before, err
    rc, _o, err = _cli("merge", p, d, "-o", tmp_path / "nowhere" / "m.jsonl")
    assert rc == 2 and f"cannot write the output {tmp_path / 'nowhere' / 'm.jsonl'}: no such directory" in err, err
