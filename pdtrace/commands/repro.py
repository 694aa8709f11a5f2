"""`pdtrace repro`: turn one request of a trace into a standalone pytest on real vLLM (CPU).

The generated test rebuilds the recorded scheduler/connector situation with
``pdtrace.testing.pd_harness`` (block size(s), hybrid state group, spec method and k,
async scheduling, prompt length) and asserts the CORRECT behaviour:
- P reports only the blocks covering remote_num_tokens (per attention group);
- after D's ``_apply_prefix_caching``, D's block i is paired with P's block i;
- P's first allocation reserves the drafter's lookahead (k+1 for DFlash, k for EAGLE-like).
On fixed vLLM the test passes. Run it with ``PDTRACE_REPRO_FAULTS=<fault>`` (the fault the
trace points at is written into the file) to re-introduce the old rule: it then fails the
way the recorded deployment did.

It rebuilds the lookahead-block-misalignment class only: for a request whose findings are all of
other classes (model-runner side) it refuses with that reason rather than write a test that
passes while the recorded deployment had a bug.

This module reads traces only; it never imports vLLM.
"""

from __future__ import annotations

import datetime
import pprint
from pathlib import Path
from typing import Any

from pdtrace.errors import PdtraceError
from pdtrace.tracefile.trace import load

from .repro_situation import _cdiv, situation  # (repro.situation: the same name as before)


def suspected_faults(s: dict[str, Any]) -> list[str]:
    """Which harness fault reproduces what the trace shows (empty: the trace looks correct)."""
    out = []
    rep, rnt = s.get("p_reported"), s.get("remote_num_tokens")
    if rep and rnt is not None:
        for g, ids in enumerate(rep):
            kind = s["group_kinds"][g] if g < len(s["group_kinds"]) else ""
            if "Mamba" in kind:
                continue
            if len(ids) > _cdiv(int(rnt), s["block_sizes"][min(g, len(s["block_sizes"]) - 1)]):
                out.append("old_p_block_rule")
                break
    if s["spec_method"] == "dflash":
        la = s.get("p_alloc_lookahead")
        want = s["num_spec_tokens"] + 1
        if (la is not None and la < want) or s["num_lookahead_tokens"] < want:
            out.append("old_dflash_lookahead")
    return out


_TEMPLATE = '''"""Repro written by `pdtrace repro` on {created}.

Trace:   {trace}
Request: {request!r} (P request {p_req!r}, D request {d_req!r})

Rebuilds the recorded P/D situation on REAL vLLM scheduler code (CPU) with
pdtrace.testing.pd_harness and asserts the correct behaviour. It passes on fixed vLLM.
What the trace showed: {verdict}
To see it fail the way the recorded deployment did, re-introduce the old rule:
    PDTRACE_REPRO_FAULTS={fault_hint} pytest {fname}
"""

import os

import pytest

pytest.importorskip("vllm", reason="needs vLLM: pip install 'pdtrace[record]'")

from pdtrace.testing import pd_harness as h  # noqa: E402

# The recorded situation (values from the trace).
RECORDED = {recorded}

CFG = h.PDConfig(
    spec_method={method!r},  # recorded: {rec_method!r}
    num_spec_tokens={k},
    block_size={bs},
    hybrid={hybrid},
    mamba_block_size={mbs},
    async_scheduling={async_},
)
PROMPT_LEN = {prompt_len}
FAULTS = tuple(f for f in os.environ.get("PDTRACE_REPRO_FAULTS", "").split(",") if f)
DFLASH_VARIANT = os.environ.get("PDTRACE_REPRO_DFLASH_VARIANT", "k")


def cdiv(a, b):
    return -(-a // b)


@pytest.fixture(scope="module")
def run():
    return h.run_pd_request(CFG, PROMPT_LEN, faults=FAULTS, dflash_variant=DFLASH_VARIANT)


def _is_state_group(g):
    return "Mamba" in h.build_kv_cache_config(CFG).kv_cache_groups[g].kv_cache_spec.__class__.__name__


def _block_size(g):
    return h.build_kv_cache_config(CFG).kv_cache_groups[g].kv_cache_spec.block_size


def test_rebuilt_situation_matches_recording(run):
    assert run.prompt_len == RECORDED["prompt_len"]
    if RECORDED["remote_num_tokens"] is not None:
        assert run.p_params["remote_num_tokens"] == RECORDED["remote_num_tokens"]


def test_p_reports_only_blocks_covering_computed_tokens(run):
    rnt = run.p_params["remote_num_tokens"]
    for g, reported in enumerate(run.p_reported):
        if _is_state_group(g):
            continue  # state groups are sent whole
        n = cdiv(rnt, _block_size(g))
        assert reported == run.p_allocated[g][:n], (
            f"group {{g}}: P reported {{reported}} for {{rnt}} tokens; the blocks covering them are "
            f"{{run.p_allocated[g][:n]}} (allocated {{run.p_allocated[g]}}, lookahead blocks must not be sent)")


def test_d_block_i_maps_to_p_block_i(run):
    for g, local in enumerate(run.trim_local):
        if _is_state_group(g):
            continue
        want = run.p_allocated[g][:len(local)]
        assert run.trim_remote[g] == want, (
            f"group {{g}}: D blocks {{local}} read P blocks {{run.trim_remote[g]}}; "
            f"D block i must be paired with P block i: {{want}}")


def test_lookahead_reserved_for_drafter(run):
    k = CFG.num_spec_tokens
    need = {{"dflash": k + 1, "eagle": k}}.get(CFG.spec_method, 0)
    first = [e for e in run.events if e["ev"] == "sched.alloc" and e["req"] == run.p_req][0]
    slots = len(first["block_ids"][0]) * _block_size(0)
    assert slots >= PROMPT_LEN + need, (
        f"P's first prefill holds {{slots}} slots for {{PROMPT_LEN}} prompt tokens; the "
        f"{{CFG.spec_method}} drafter writes KV for {{need}} positions past the prompt")
'''


def render(s: dict[str, Any], trace_path: str, fname: str) -> str:
    sus = suspected_faults(s)
    if sus:
        verdict = "the old rule(s) " + ", ".join(sus) + " (see RECORDED below)"
    else:
        verdict = "no known fault (the test should pass here; it pins the recorded situation)"
    bs = s["block_sizes"]
    recorded = pprint.pformat({k: s[k] for k in (
        "p_req", "d_req", "block_sizes", "group_kinds", "spec_method", "num_spec_tokens", "num_lookahead_tokens",
        "async_scheduling", "prompt_len", "remote_num_tokens", "p_allocated", "p_reported", "p_alloc_lookahead",
        "d_local", "trim_local", "trim_remote", "recorded_faults")}, width=100, sort_dicts=False)
    return _TEMPLATE.format(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        trace=trace_path, request=s["request"], p_req=s["p_req"], d_req=s["d_req"],
        verdict=verdict, fault_hint=",".join(sus) or "old_p_block_rule", fname=fname,
        recorded=recorded.replace("\n", "\n" + " " * 0),
        method=s["harness_method"], rec_method=s["spec_method"], k=s["num_spec_tokens"] if s["harness_method"] else 0,
        bs=bs[0], hybrid=s["hybrid"], mbs=(bs[1] if s["hybrid"] and len(bs) > 1 else None),
        async_=s["async_scheduling"], prompt_len=s["prompt_len"],
    )


# The one class whose situation repro rebuilds (scheduler + connector, on CPU). The other classes
# happen in the model runner (phases, drafter windows, row moves, accepted-count copies).
REBUILT_CLASS = "lookahead-block-misalignment"


def run(trace: Any, request: str | None = None, output: Any = "test_repro.py", lenient: bool = False,
        cause: int | None = None) -> int:
    if (request is None) == (cause is None):
        raise PdtraceError("repro: give one of --cause N (a root cause `pdtrace check` lists: a standalone vLLM "
                           "test) or --request ID (the harness test of one request)")
    if cause is not None:
        from pdtrace.commands import repro_standalone

        return repro_standalone.run(trace, cause, output, lenient=lenient)
    from pdtrace.detectors import run_all

    t = load(str(trace), lenient=lenient)
    kinds = {f.kind for f in run_all(t.events, t.header, request=request)}
    other = sorted(kinds - {REBUILT_CLASS})
    if other and REBUILT_CLASS not in kinds:
        raise PdtraceError(
            f"{trace}: request {request!r} has finding(s) of {', '.join(other)}, which repro cannot rebuild: it "
            f"rebuilds the scheduler / connector situation ({REBUILT_CLASS}) only, and these happen in the model "
            "runner on a GPU. Attach the trace instead (`pdtrace bundle`); `pdtrace check --request` explains them")
    s = situation(t.events, request)
    out = Path(output)
    text = render(s, str(trace), out.name)
    out.write_text(text)
    sus = suspected_faults(s)
    print(f"wrote {out}: rebuilds request {request!r} ({s['spec_method'] or 'no spec'}, k={s['num_spec_tokens']}, "
          f"block sizes {s['block_sizes']}, prompt_len {s['prompt_len']}) on real vLLM (CPU)")
    if sus:
        print(f"the trace matches the old rule(s): {', '.join(sus)}; "
              f"PDTRACE_REPRO_FAULTS={','.join(sus)} pytest {out} re-introduces them (the test then fails)")
    return 0
