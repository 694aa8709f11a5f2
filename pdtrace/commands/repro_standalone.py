"""`pdtrace repro TRACE --cause N` (issue 61): the regression test a fix lands with, for one root cause of a trace.

The file it writes runs with pytest and vLLM alone (no pdtrace import), in the style of vLLM's
tests/v1/kv_connector/unit/, so it can be pasted into a vLLM pull request. It rebuilds the recorded situation on
the installed vLLM's own Scheduler, KV cache manager and NIXL connector (scheduler side, CPU) with the recorded
block size, speculative method and k, async setting, prompt lengths and step order, and asserts on vLLM's objects
what the finding says was broken, never on pdtrace's verdict. It fails on the release whose bug the trace shows and
passes where that bug is fixed.

Rebuilt so far (``BUILDERS``, by the root cause's mechanism): P's lookahead report (vLLM #44151) on the recorded KV
cache groups, D's uneven trim of a chunked-local group (the Llama 4 chunk boundary) and D's blocks past P's tokens
(vLLM #50558; the release's own _apply_prefix_caching), the DFlash drafter window (seed 003), a KV load rollback
that keeps async placeholders (vLLM #49250 / #45138) or keeps the token of the step in flight, failed blocks shared
through D's prefix cache read before they are recomputed, the KV invariant's in-flight write and read (vLLM #37285,
#47282), the drafter's KV cache group left out of the transfer (vLLM #54926's shape), P's NIXL lease run out before
D's read (vLLM #52234), and, worker side: an accepted-token count read after InputBatch row moves (seed 004, vLLM
#51571; a faithful minimal caller) and the connector metadata cleared before the drafter's forward (vLLM #34529;
vLLM's own LLM() and model runner with a recording connector, where a GPU or vLLM's CPU build runs a model). Some
causes are refused with their reason (``REFUSED``). Every other cause gets one line saying so and exit 2. The facts
come from ``repro_facts``; the text from ``repro_templates*`` and the shared parts (constants, docstring,
provenance) from ``repro_text``. This module never imports vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pdtrace.commands import repro_facts as facts
from pdtrace.commands import repro_templates as tpl
from pdtrace.commands import repro_templates_kv as tpl_kv
from pdtrace.commands import repro_templates_lease as tpl_lease
from pdtrace.commands import repro_templates_trim as tpl_trim
from pdtrace.commands import repro_templates_worker as tpl_worker
from pdtrace.commands.repro_text import (LAYOUT_FAULTS, close_doc, common, constants, doc_base, faults_of, short,
                                         tiny_config, write_file)
from pdtrace.errors import PdtraceError

def _lookahead(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    from pdtrace.commands.repro_situation import situation

    s = situation(events, str(c.first.get("req")))
    groups = facts.lookahead_groups(s, trace, c.n)
    doc, const = common(s, trace, c, vllm, groups=bool(groups))
    doc.update(prompt_len=s["prompt_len"], p_req=s["p_req"], groups_words=_groups_words(groups))
    return write_file(tpl.LOOKAHEAD_DOC, doc, {"PROMPT_LEN": s["prompt_len"], "GROUPS": groups, **const},
                 tpl.LOOKAHEAD_TEST, events, header, c)


def _dflash(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.drafter_window(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    doc.update(prompt_len=s["prompt_len"], req=s["req"], inst=s["inst"], role=s["kv_role"])
    return write_file(tpl.DFLASH_DOC, doc, {"PROMPT_LEN": s["prompt_len"], "KV_ROLE": s["kv_role"], **const},
                 tpl.DFLASH_TEST, events, header, c)


def _rollback(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.rollback(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    doc.update(req=s["req"], prompt_len=s["prompt_len"], max_tokens=s["max_tokens"], failed=s["failed_indexes"],
               n_blocks=s["n_blocks"], placeholders=s["placeholders"])
    return write_file(tpl_kv.ROLLBACK_DOC, doc, {"P_REQ": s["p_req"], "D_REQ": s["req"], "PROMPT_LEN": s["prompt_len"],
                                            "MAX_TOKENS": s["max_tokens"], "FAILED_BLOCK_INDEXES": s["failed_indexes"],
                                            **const}, tpl_kv.ROLLBACK_TEST, events, header, c)


def _inflight(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.in_flight_token(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    doc.update(req=s["req"], prompt_len=s["prompt_len"], max_tokens=s["max_tokens"], failed=s["failed_indexes"],
               report_step=s["report_step"], in_flight=s["in_flight"])
    return write_file(tpl_kv.INFLIGHT_DOC, doc, {
        "P_REQ": s["p_req"], "D_REQ": s["req"], "PROMPT_LEN": s["prompt_len"], "MAX_TOKENS": s["max_tokens"],
        "FAILED_BLOCK_INDEXES": s["failed_indexes"], "REPORT_AT": s["report_at"], "FIRST_STEP": s["first_step"], "STEPS": s["steps"],
        **const},
        tpl_kv.INFLIGHT_TEST, events, header, c)


def _shared(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.shared_block(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    doc.update(r1=s["r1"], r2=s["r2"], r1_len=s["r1_len"], r2_len=s["r2_len"], shared=s["shared_tokens"],
               failed=s["failed_indexes"], chunk=s["chunk"], budget=s["max_num_batched_tokens"])
    return write_file(tpl_kv.SHARED_DOC, doc, {
        "R1": s["r1"], "R2": s["r2"], "R1_LEN": s["r1_len"], "R2_LEN": s["r2_len"], "SHARED_TOKENS": s["shared_tokens"],
        "R1_MAX_TOKENS": s["r1_max_tokens"], "R2_MAX_TOKENS": s["r2_max_tokens"],
        "FAILED_BLOCK_INDEXES": s["failed_indexes"], "CHUNK": s["chunk"],
        "MAX_NUM_BATCHED_TOKENS": s["max_num_batched_tokens"], "STEPS_BEFORE_FAILURE": s["steps_before"],
        **const}, tpl_kv.SHARED_TEST, events, header, c)


def _reown(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.in_flight_write(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    doc.update(a=s["a"], b=s["b"], p=s["p"], a_len=s["a_len"], b_len=s["b_len"], stop_at=s["stop_at"],
               num_blocks=s["num_blocks"])
    return write_file(tpl_kv.REOWN_DOC, doc, {
        "A_REQ": s["a"], "B_REQ": s["b"], "P_REQ": s["p"], "A_LEN": s["a_len"], "A_MAX_TOKENS": s["a_max_tokens"],
        "STOP_AT": s["stop_at"], "B_LEN": s["b_len"], "NUM_BLOCKS": s["num_blocks"],
        "MAX_MODEL_LEN": s["max_model_len"], **const}, tpl_kv.REOWN_TEST, events, header, c)


def _prune(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.in_flight_read(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm, window=s["window"])
    doc.update(a=s["a"], b=s["b"], p=s["p"], a_len=s["a_len"], b_len=s["b_len"], window=s["window"],
               num_blocks=s["num_blocks"])
    return write_file(tpl_kv.PRUNE_DOC, doc, {
        "A_REQ": s["a"], "B_REQ": s["b"], "P_REQ": s["p"], "A_LEN": s["a_len"], "A_MAX_TOKENS": s["a_max_tokens"],
        "B_LEN": s["b_len"], "NUM_BLOCKS": s["num_blocks"], **const}, tpl_kv.PRUNE_TEST, events, header, c)




def _drafter_group(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.drafter_group(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm, groups=True)
    words = "\n".join(f"- group {g}: {', '.join(x['layers'])}" + (" (the drafter's)" if x["eagle"] else "")
                       + (", transfers" if x["transfer"] else ", left out of the transfer")
                       for g, x in enumerate(s["groups"]))
    doc.update(req=s["req"], p_req=s["p_req"], prompt_len=s["prompt_len"], groups_words=words)
    return write_file(tpl_kv.DRAFTER_GROUP_DOC, doc, {"P_REQ": s["p_req"], "D_REQ": s["req"], "PROMPT_LEN": s["prompt_len"],
                                                 "GROUPS": s["groups"], **const},
                 tpl_kv.DRAFTER_GROUP_TEST, events, header, c)


def _groups_words(groups: list[dict] | None) -> str:
    """"; 6 KV cache groups as recorded: 0-4 sliding windows of 64 tokens, 5 full attention" ("" for one group)."""
    import itertools

    if not groups:
        return ""
    runs, g0 = [], 0
    for (w, ch), run in itertools.groupby((g["window"], g["chunk"]) for g in groups):
        n = len(list(run))
        what = (f"sliding window{'s' if n > 1 else ''} of {w} tokens" if w else
                f"chunked-local attention, chunks of {ch} tokens" if ch else "full attention")
        runs.append(f"{g0}-{g0 + n - 1} {what}" if n > 1 else f"{g0} {what}")
        g0 += n
    return f"; {len(groups)} KV cache groups as recorded: " + ", ".join(runs)


def _uneven_trim(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    from pdtrace.commands.repro_situation import situation

    d = (finding.data or {}) if finding is not None else {}
    s = situation(events, str(d.get("d_req") or c.first.get("req")))
    groups = facts.lookahead_groups(s, trace, c.n)
    doc, const = common(s, trace, c, vllm, groups=bool(groups))
    doc.update(prompt_len=s["prompt_len"], p_req=s["p_req"], d_req=s["d_req"], groups_words=_groups_words(groups),
               uneven=", ".join(str(u[0]) for u in d.get("uneven_trim") or []) or "?")
    return write_file(tpl_trim.UNEVEN_TRIM_DOC, doc, {"P_REQ": s["p_req"], "D_REQ": s["d_req"],
                                                 "PROMPT_LEN": s["prompt_len"], "GROUPS": groups, **const},
                 tpl_trim.UNEVEN_TRIM_TEST, events, header, c)


def _past_p(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.past_p(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    k = s["d_cached_blocks"]
    doc.update(p_len=s["p_len"], d_len=s["d_len"], p_req=s["p_req"], d_req=s["d_req"], groups_words="",
               cached_words=f"; D's prefix cache held the prompt's first {k} block(s)" if k else "")
    return write_file(tpl_trim.PAST_P_DOC, doc, {"P_REQ": s["p_req"], "D_REQ": s["d_req"], "P_LEN": s["p_len"],
                                            "D_LEN": s["d_len"], "D_CACHED_BLOCKS": k, "GROUPS": None, **const},
                 tpl_trim.PAST_P_TEST, events, header, c)


def _lease(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.expired_lease(events, finding, trace, c.n)
    doc, const = common(s, trace, c, vllm)
    after = s["read_after_s"]
    doc.update(p_req=s["p_req"], d_req=s["d_req"], held_len=s["held_len"], blocks=s["blocks"], lease=s["lease_s"],
               retrieved=s["retrieved"], other=s["other"], other_len=s["other_len"], num_blocks=s["num_blocks"],
               after=f"{after:.2f} s" if isinstance(after, (int, float)) and after > 0 else "(by the trace) ")
    return write_file(tpl_lease.LEASE_DOC, doc, {
        "HELD": s["p_req"], "OTHER": s["other"], "D_REQ": s["d_req"], "HELD_LEN": s["held_len"],
        "OTHER_LEN": s["other_len"], "LEASE_S": s["lease_s"], "NUM_BLOCKS": s["num_blocks"], **const},
        tpl_lease.LEASE_TEST, events, header, c)


def _stale(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.stale_read(events, finding, trace, c.n, c.mechanism)
    mode = s["mamba_cache_mode"]
    doc = {**doc_base(trace, c, vllm), "mechanism": c.mechanism, "async_": s["async_scheduling"],
           "method_words": f"{s['spec_method']} with {s['num_spec_tokens']} speculative tokens",
           "mode_words": "mamba_cache_mode 'align': the gather through prev_positions" if mode == "align" else
           "outside align mode", "req": s["req"], "row": s["row"], "value": s["value"], "own": s["own"]}
    const = {"BLOCK_SIZE": s["block_size"], "NUM_SPEC_TOKENS": s["num_spec_tokens"],
             "ASYNC_SCHEDULING": s["async_scheduling"], "MAMBA_CACHE_MODE": mode,
             "UPSTREAM": ", ".join(short(u) for u in c.upstream) or "seed 004 / vLLM #51571"}
    return (close_doc(tpl_worker.STALE_DOC.format(**doc), events, header, c, vllm) + tpl.PREAMBLE + f"# recorded: {trace}, root cause {c.n}\n"
            + constants(**const) + "\n\ndef _cdiv(a, b):\n    return -(-a // b)\n" + tpl_worker.stale_test_text())


def _metadata(events: list, header: dict, c: Any, finding: Any, trace: str, vllm: str) -> str:
    s = facts.metadata_cleared(events, finding, trace, c.n)
    k = s["num_spec_tokens"] or 1
    doc = {**doc_base(trace, c, vllm), "mechanism": c.mechanism, "async_": s["async_scheduling"],
           "method_words": f"{s['spec_method']} with {k} speculative tokens", "method": s["spec_method"],
           "inst": s["inst"], "role": s["kv_role"], "step": s["step"], "drafter": s["drafter_layers"] or "?",
           "target": s["target_layers"] or "?", "req": s["req"], "prompt_len": s["prompt_len"],
           "target_n": max(1, len(s["target_layers"]))}
    const = {"BLOCK_SIZE": s["block_sizes"][0], "SPEC_METHOD": s["spec_method"], "NUM_SPEC_TOKENS": k,
             "ASYNC_SCHEDULING": s["async_scheduling"], "KV_ROLE": s["kv_role"], "PROMPT_LEN": s["prompt_len"],
             "MAX_TOKENS": s["max_tokens"], "TARGET_LAYERS": doc["target_n"], "TARGET": tiny_config("tiny-llama"),
             "DRAFT": tiny_config("tiny-eagle")}
    return (close_doc(tpl_worker.META_DOC.format(**doc), events, header, c, vllm) + tpl.PREAMBLE
            + f"# recorded: {trace}, root cause {c.n}\n" + constants(**const) + tpl_worker.META_HEAD + tpl.BASIC
            + tpl_worker.META_TEST)


# mechanism (causes.Cause.mechanism), or class, -> builder; a cause of another mechanism gets one line and exit 2
BUILDERS: dict[str, Callable[..., str]] = {
    # P's report of lookahead blocks (vLLM #44151): the blocks it hands D. D's own trim (past-p, uneven-trim), a
    # read of blocks P never reported and an inconclusive trim are not P's report: not rebuilt by this test
    "lookahead/shifted": _lookahead,
    "lookahead/latent": _lookahead,
    "lookahead/uneven-trim": _uneven_trim,
    "lookahead/past-p": _past_p,
    "drafter-window": _dflash,
    "kv-load/placeholders": _rollback,
    "kv-load/shared-block-read-early": _shared,
    "kv-load/in-flight-token": _inflight,
    "kv-invariant/in-flight-write": _reown,
    "kv-invariant/in-flight-read": _prune,
    "never-crossed/drafter-group": _drafter_group,
    "never-crossed/expired-lease": _lease,
    "metadata-cleared": _metadata,
    "stale-accepted-count-read": _stale,  # (by class: every mechanism is a read after row moves, or refused)
}
REBUILT = "lookahead blocks (vLLM #44151), the DFlash drafter window, a KV-load rollback's placeholders and its " \
          "step in flight (vLLM #49250), failed blocks shared through the prefix cache, a KV load into blocks a step in flight writes " \
          "(#37285) or reads (#47282), the drafter's KV cache group left out of the transfer (#54926's shape), an " \
          "accepted count read after row moves (seed 004, #51571), the connector metadata cleared before the drafter " \
          "(#34529), P's NIXL lease run out before D's read (#52234), D's uneven trim of a chunked-local group (the " \
          "Llama 4 chunk boundary), D's blocks past P's tokens from a longer D prompt (#50558)"


# why a mechanism is not rebuilt, where there is more to say than "not yet" (one line each)
REFUSED = {
    "never-crossed/no-params": "the params were dropped outside vLLM (a router or proxy between P and D), so no vLLM "
                               "test can fail for it: the fix, and its test, belong to that component",
}


def run(trace: Any, n: int, output: Any, lenient: bool = False) -> int:
    from pdtrace.detectors import by_severity, run_all
    from pdtrace.detectors.causes import group
    from pdtrace.tracefile.damage import incomplete_reason, warn_problems
    from pdtrace.tracefile.trace import load

    t = load(str(trace), lenient=lenient)
    warn_problems(t)
    damage = incomplete_reason(t.footer, t.problems)  # (a damaged trace read with --lenient: the test says so)
    findings = by_severity(run_all(t.events, t.header))
    causes = group(findings)
    if not causes:
        raise PdtraceError(f"{trace}: no root cause (check finds nothing): there is no failing test to write")
    if not 1 <= n <= len(causes):
        which = "cause 1 only" if len(causes) == 1 else f"causes 1-{len(causes)}"
        raise PdtraceError(f"{trace}: --cause {n}: the trace has {len(causes)} root cause(s), {which} "
                           f"(pdtrace check {trace} lists them)")
    c = causes[n - 1]
    text = for_cause(t.events, {**t.header, "_damaged": damage} if damage else t.header, c, str(trace), findings)
    out = Path(output)
    try:
        out.write_text(text)
    except OSError as exc:
        raise PdtraceError(f"{out}: cannot write the test: {exc.strerror or exc}") from None
    faults = faults_of(t.events, t.header)
    said = (f"The trace's layout came from a labelled fault ({', '.join(faults)}): the test rebuilds that layout, so "
            f"it fails on its own vLLM too." if c.mechanism in LAYOUT_FAULTS else
            f"The trace's finding came from a labelled fault ({', '.join(faults)}): its own vLLM has the fix.")
    print(f"wrote {out}: cause {n} ({c.kind}), request {c.first.get('req')}")
    print(_indented("A standalone vLLM test (pytest and vLLM only): it fails on the releases whose code has this bug "
                    "and passes where it is fixed." + (" " + said if faults else "")))
    return 0


def _indented(text: str) -> str:
    """``text`` filled to the terminal's width (at most 100), indented under the "wrote" line."""
    import shutil
    import textwrap

    width = min(100, shutil.get_terminal_size((80, 24)).columns)
    return textwrap.fill(text, width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def for_cause(events: list, header: dict, c: Any, trace: str, findings: list | None = None) -> str:
    """The standalone test of root cause ``c``; PdtraceError (one line) where it cannot be rebuilt. ``findings``:
    the list ``c`` indexes (``by_severity(run_all(...))``), computed here when not given."""
    from pdtrace.detectors.causes import header_vllm

    build = BUILDERS.get(c.mechanism) or BUILDERS.get(c.kind)
    if build is None and c.mechanism in REFUSED:
        raise PdtraceError(f"{trace}: cause {c.n} ({c.kind}: {c.mechanism}) is not rebuilt as a vLLM test: "
                           f"{REFUSED[c.mechanism]}; attach the trace (pdtrace bundle)")
    if build is None:
        raise PdtraceError(f"{trace}: cause {c.n} ({c.kind}: {c.mechanism}) cannot be rebuilt yet: repro writes a "
                           f"standalone vLLM test for {REBUILT} so far; attach the trace (pdtrace bundle) and see "
                           f"`pdtrace check {trace} --cause {c.n}`")
    if findings is None:
        from pdtrace.detectors import by_severity, run_all

        findings = by_severity(run_all(events, header))
    finding = findings[c.first["index"]] if 0 <= c.first.get("index", -1) < len(findings) else None
    return build(events, header, c, finding, trace, header_vllm(header))
