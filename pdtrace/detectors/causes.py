"""Root causes: findings that share a class, a mechanism and the vLLM code path that produced
them, as one cause (issue 49). The race recording's 283 findings are one cause (a row move after
the accepted-count copy landed, read through the old row: vLLM #51571).

A cause's mechanism comes from the findings' own data (what each detector recorded: the stale
read's reasons and row mapping, the lookahead pairing's rule, the KV-load handler's outcome), its
code path from the hooks that recorded the events (where in vLLM: the file and first line of each
wrapped function, from the trace's ``hooks.status`` events, or for traces recorded before they
carried it, from the table of the releases' own code, ``vllm_where.json``).

Pure: findings (or their JSON dicts) and the trace's hook locations in, ``Cause`` objects out.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable

from .base import (DRAFTER_WINDOW_OUTSIDE_ALLOCATION, KV_INVARIANT, KV_LOAD_FAILURE_RECOVERY, KV_NEVER_CROSSED,
                   LOOKAHEAD_MISALIGNMENT, METADATA_CLEARED_BEFORE_DRAFTER, STALE_ACCEPTED_COUNT_READ)

VLLM = "https://github.com/vllm-project/vllm"

# mechanism -> (title, the hooks on its code path (the first is where the damage is done), upstream)
MECHANISMS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "stale-read/row-moved/prev": (
        "a row move ({moves}) after the accepted-count copy landed: _prepare_inputs read the count through "
        "the request's previous row (prev_positions), which then held another request's count",
        ("accepted_counts.read", "input_batch.{move}", "accepted_counts.issue"), ("51571", "51599")),
    "stale-read/unsynchronized": (
        "_prepare_inputs read the accepted counts from their device-to-host copy without waiting for it: "
        "before it landed, or after it landed in rows that had moved since its issue ({moves})",
        ("accepted_counts.read", "accepted_counts.issue", "input_batch.{move}"), ("45100",)),
    "stale-read/wrong-landing-unknown": (
        "accepted counts read unsynchronized that differ from the authoritative count, in a recording that "
        "does not say when the copy landed among the row moves ({moves})",
        ("accepted_counts.read", "accepted_counts.issue", "input_batch.{move}"), ()),
    "stale-read/landing-unknown": (
        "accepted counts read after row moves, where the trace does not say when the copy landed",
        ("accepted_counts.read", "accepted_counts.issue"), ()),
    "lookahead/shifted": (
        "P reported spec-decode lookahead blocks past the prompt's tokens, and D's end-trim "
        "(_apply_prefix_caching, remote[-n:]) shifted the block mapping",
        ("nixl.trim", "nixl.request_finished", "scheduler.allocate_slots"), ("44151",)),
    "lookahead/past-p": (
        "D's blocks to load reach past the tokens P computed (local > remote), and the end-trim pairs them "
        "with the wrong P blocks", ("nixl.trim", "nixl.remote_alloc"), ("50558",)),
    "lookahead/not-reported": (
        "D read P blocks that P did not report for the request: the transfer's remote block ids are another "
        "request's or out of range, and the read succeeds", ("nixl.remote_alloc", "nixl.request_finished"),
        ("52234",)),
    "lookahead/uneven-trim": (
        "D's trim paired block lists of different lengths (a chunked-local group with nothing to load), "
        "which _read_blocks asserts against", ("nixl.trim", "nixl.read"), ()),
    "lookahead/latent": (
        "P reports trailing spec-decode lookahead blocks (latent: D's mapping still right)",
        ("nixl.request_finished", "scheduler.allocate_slots"), ("44151",)),
    "lookahead/inconclusive": (
        "D end-trims P's blocks, and the trace does not say how many tokens P computed",
        ("nixl.trim",), ()),
    "drafter-window": (
        "the {method} drafter writes KV at positions outside the blocks the scheduler allocated",
        ("accepted_counts.window", "scheduler.allocate_slots"), ("42971",)),
    "metadata-cleared": (
        "the KV connector metadata was cleared before the drafter ran, so the drafter's layers saved no KV",
        ("connector_metadata.clear", "connector_metadata.drafter_propose", "connector_metadata.save_layer"),
        ("34529",)),
    "kv-load/handler-raised": (
        "the scheduler's KV-load failure handler raised; nothing in the engine core's step catches it",
        ("kv_load.invalid_blocks", "kv_load.failed_recving"), ("50687", "56855")),
    "kv-load/refused": (
        "vLLM refused a block-level KV-load failure on a model with several KV cache groups (fail closed, by "
        "design): the scheduler raised and the engine core died", ("kv_load.invalid_blocks",), ("56855",)),
    "kv-load/shared-block-read-early": (
        "a failed block shared by two requests: vLLM let one keep it as computed while the other recomputes it, "
        "and under chunked prefill it was read before the rewrite",
        ("kv_load.invalid_blocks", "scheduler.schedule"), ()),
    "kv-load/in-flight-token": (
        "a step in flight at a KV-load rollback ran on the failed KV, and its sampled token was appended to the "
        "output after the rollback", ("kv_load.invalid_blocks", "kv_load.output"), ("49250",)),
    "kv-load/no-restart": (
        "after a failed KV load the recompute did not restart at the first failed block",
        ("kv_load.invalid_blocks",), ()),
    "kv-load/placeholders": (
        "a KV-load rollback left the request's async output placeholders in place: it is scheduled past its "
        "tokens, or stalls in the running queue", ("kv_load.invalid_blocks", "scheduler.schedule"),
        ("49250", "45138")),
    "kv-load/over-scheduled": (
        "after a KV-load rollback the scheduler scheduled more tokens than the request had left",
        ("kv_load.invalid_blocks", "scheduler.schedule"), ("49250",)),
    "kv-load/stalled": (
        "after a KV-load recompute the request stopped being scheduled and never finished",
        ("kv_load.invalid_blocks", "scheduler.schedule"), ("45138",)),
    "kv-load/never-ran-again": (
        "a request rolled back after a KV-load failure was never scheduled again",
        ("kv_load.invalid_blocks", "kv_load.failed_recving", "scheduler.schedule"), ()),
    "kv-load/failed-not-finished": (
        "a request failed for a KV-load failure never finished (the client waits for it)",
        ("kv_load.failed_recving", "scheduler.finish"), ()),
    "kv-load/other": ("{title}", ("kv_load.invalid_blocks", "kv_load.failed_recving"), ()),
    "never-crossed/no-params": (
        "prefill ran twice: requests reached D without the kv_transfer_params P returned, and D prefilled "
        "them again (whatever sits between P and D dropped them)", ("scheduler.add_request",
                                                                     "scheduler.allocate_slots"), ()),
    "never-crossed/nothing-loaded": (
        "prefill ran twice: D had the transfer params but its connector loaded none of what P computed",
        ("scheduler.allocate_slots", "nixl.remote_alloc"), ()),
    "never-crossed/partial-load": (
        "partial loads: D's connector loaded fewer prompt tokens than P computed, and D computed the rest",
        ("scheduler.allocate_slots", "nixl.remote_alloc"), ()),
    "never-crossed/drafter-group": (
        "the drafter's KV cache group is not among the transfer groups: D loads the prompt into the target's "
        "groups only, counts it computed, and its drafter reads blocks nobody wrote",
        ("scheduler.init", "scheduler.allocate_slots", "nixl.remote_alloc"), ("54926",)),
    "never-crossed/expired-lease": (
        "D read KV that P had already released: P's NIXL lease on the request ran out before D's read, P freed the "
        "blocks for other requests, and D decoded on whatever they held (vLLM only logs it on P)",
        ("nixl.lease_expired", "nixl.read"), ("52234",)),
    # the KV invariant's own causes, where no rule names the mechanism (kv_invariant: what the chain shows)
    "kv-invariant/shifted": (
        "KV read that is not the request's own: a KV transfer filled D's blocks with other token blocks of the same "
        "prompt (the block mapping is shifted)", ("nixl.read", "nixl.trim", "nixl.request_finished"), ()),
    "kv-invariant/p-unwritten": (
        "KV read that is not the request's own: D loaded P blocks that P never wrote for the prompt",
        ("nixl.read", "nixl.request_finished"), ()),
    "kv-invariant/reused": (
        "KV read that is not the request's own: D read P's blocks after P had freed them and written another "
        "prompt's KV into them", ("nixl.read", "scheduler.free"), ()),
    "kv-invariant/foreign": (
        "KV read that is not the request's own: a step attended to blocks that hold another prompt's KV",
        ("scheduler.schedule", "scheduler.allocate_slots"), ()),
    "kv-invariant/short": (
        "KV read that is not the request's own: a step attended to positions of its blocks that nothing wrote",
        ("scheduler.schedule", "scheduler.allocate_slots"), ()),
    "kv-invariant/not-loaded": (
        "KV read that is not the request's own: D counted tokens loaded whose blocks no KV transfer wrote",
        ("scheduler.allocate_slots", "nixl.remote_alloc", "nixl.read"), ()),
    "kv-invariant/failed-load": (
        "KV read that is not the request's own: a step attended to blocks whose KV load failed",
        ("kv_load.invalid_blocks", "scheduler.schedule"), ()),
    "kv-invariant/unwritten": (
        "KV read that is not the request's own: a step attended to blocks handed to the request that nothing wrote",
        ("scheduler.allocate_slots", "scheduler.schedule"), ()),
    "kv-invariant/null-block": (
        "KV read that is not the request's own: a sliding-window or chunked-local step attended to positions whose "
        "blocks vLLM had already replaced by its null block", ("scheduler.allocate_slots", "scheduler.schedule"), ()),
    "kv-invariant/in-flight": (
        "KV read that is not the request's own: a step in flight at a failed load read the failed blocks and its "
        "token was kept", ("kv_load.invalid_blocks", "kv_load.output"), ()),
    "kv-invariant/in-flight-write": (
        "KV load into blocks a step in flight still writes: a request finished while its next step was in flight "
        "(async scheduling), its blocks were freed at once and handed to a request loading KV from P, whose NIXL read "
        "is not ordered against that step's write (vLLM #37285, fixed by PR #45357 in 0.24)",
        ("scheduler.free", "scheduler.allocate_slots", "kv_load.output"), ("37285",)),
    "kv-invariant/in-flight-read": (
        "KV load into a block a step in flight still reads: under async scheduling vLLM pruned a sliding-window "
        "block by the optimistic token count while the step before still attended to it, and handed it to a "
        "request loading KV from P (vLLM #47282, fixed by PR #47728 in 0.26)",
        ("scheduler.allocate_slots", "scheduler.schedule", "kv_load.output"), ("47282",)),
    "kv-invariant/digest-differs": (
        "the KV D decoded on differs from what P computed: the bytes of a loaded block before D's first forward are "
        "not those P's block held when its request was final (record --kv-checksum)",
        ("nixl.digest_layers", "nixl.read"), ()),
    "kv-invariant/write-outside": (
        "the {method} drafter wrote KV past the blocks the request holds (into blocks that are not its own)",
        ("accepted_counts.window", "scheduler.allocate_slots"), ()),
}

# mechanisms whose fault is outside vLLM (its code runs as designed on what it was given)
OUTSIDE_VLLM = frozenset({"never-crossed/no-params"})

_MOVE_HOOK = {"swap": "swap", "condense": "condense", "add": "add", "remove": "remove"}


def _get(f: Any, k: str) -> Any:
    return f.get(k) if isinstance(f, dict) else getattr(f, k)


def mechanism(f: Any) -> tuple[str, dict[str, str]]:
    """(mechanism key, the words its title template takes) of a finding or its JSON dict."""
    kind, d = _get(f, "kind"), _get(f, "data") or {}
    if kind == STALE_ACCEPTED_COUNT_READ:
        reasons = d.get("reasons") or []
        ops = sorted({h.get("op", "") for h in d.get("row_history") or [] if h.get("op")})
        words = {"move": ",".join(ops)}
        if "value-wrong" in reasons:
            return "stale-read/wrong-landing-unknown", words
        if "row-moved" in reasons and d.get("mapping") == "prev" and "copy-not-complete" not in reasons:
            return "stale-read/row-moved/prev", words
        if "row-moved" in reasons or "copy-not-complete" in reasons:
            return "stale-read/unsynchronized", words
        return "stale-read/landing-unknown", words
    if kind == LOOKAHEAD_MISALIGNMENT:
        sev = _get(f, "severity")
        if "uneven_trim" in d:
            return "lookahead/uneven-trim", {}
        if d.get("not_reported"):
            return "lookahead/not-reported", {}
        if sev == "inconclusive":
            return "lookahead/inconclusive", {}
        if sev == "warning":
            return "lookahead/latent", {}
        return ("lookahead/past-p" if "unpaired_local" in d else "lookahead/shifted"), {}
    if kind == DRAFTER_WINDOW_OUTSIDE_ALLOCATION:
        return "drafter-window", {"method": str(d.get("method") or "")}
    if kind == METADATA_CLEARED_BEFORE_DRAFTER:
        return "metadata-cleared", {}
    if kind == KV_LOAD_FAILURE_RECOVERY:
        if d.get("refused"):
            return "kv-load/refused", {}
        if "error" in d and "failed_loads" in d:
            return "kv-load/handler-raised", {}
        if d.get("shared") and "recomputer" in d:
            return "kv-load/shared-block-read-early", {}
        if "in_flight_step" in d:
            return "kv-load/in-flight-token", {}
        if "restart_at" in d:
            return "kv-load/no-restart", {}
        if ("scheduled" in d or "steps_without_it" in d) and d.get("placeholders"):
            return "kv-load/placeholders", {}
        if "scheduled" in d and "left" in d:
            return "kv-load/over-scheduled", {}
        if "steps_without_it" in d:
            return "kv-load/stalled", {}
        if "retry" in d:
            return "kv-load/never-ran-again", {}
        if set(d) == {"policy", "source"}:
            return "kv-load/failed-not-finished", {}
        title = str(_get(f, "title") or "")
        return "kv-load/other:" + _shape(title), {"title": _shape(title)}
    if kind == KV_INVARIANT:
        return f"kv-invariant/{d.get('mechanism') or 'other'}", {"method": str(d.get("method") or "")}
    if kind == KV_NEVER_CROSSED and d.get("mechanism") in ("no-params", "nothing-loaded", "partial-load",
                                                           "drafter-group", "expired-lease"):
        return f"never-crossed/{d['mechanism']}", {}
    return f"{kind}/other", {"title": str(kind)}


def _shape(title: str) -> str:
    """A title with its request ids and numbers taken out: what findings of one shape share."""
    words = title.split(":", 1)[-1] if title.split(":", 1)[0].count(" ") == 0 else title
    return " ".join("N" if any(c.isdigit() for c in w) else w for w in words.split()).strip()


@dataclasses.dataclass
class Cause:
    n: int  # 1-based, in the order causes are listed (errors first)
    kind: str
    mechanism: str
    title: str
    severity: str  # the worst of its findings
    findings: list[int]  # indices into the findings list given to ``group``
    errors: int = 0
    warnings: int = 0
    inconclusive: int = 0
    requests: list[str] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)  # [first, last]
    instances: list[str] = dataclasses.field(default_factory=list)
    where: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # [{hook, function, file, line}]
    upstream: list[str] = dataclasses.field(default_factory=list)  # links
    first: dict[str, Any] = dataclasses.field(default_factory=dict)  # {index, req, step, title}
    confirmed: int = 0  # the KV invariant's findings on this cause's requests that joined it (one bug, one cause)

    @property
    def where_words(self) -> str:
        """How the vLLM locations are introduced: where vLLM has the bug, or (a fault outside vLLM,
        e.g. a router that dropped the params) only where vLLM saw it."""
        return "seen in vLLM at" if self.mechanism in OUTSIDE_VLLM else "in vLLM"

    def counts_text(self) -> str:
        parts = [f"{self.errors} error(s)" if self.errors else "",
                 f"{self.warnings} warning(s)" if self.warnings else "",
                 f"{self.inconclusive} inconclusive" if self.inconclusive else ""]
        steps = (f"step {self.steps[0]}" if self.steps and self.steps[0] == self.steps[1] else
                 f"steps {self.steps[0]}-{self.steps[1]}" if self.steps else "")
        return ", ".join(p for p in (*parts, f"{len(self.requests)} request(s)" if self.requests else "", steps,
                                     f"instance(s) {', '.join(self.instances)}" if self.instances else "",
                                     f"and {self.confirmed} kv-invariant finding(s) that confirm the reads"
                                     if self.confirmed else "")
                         if p)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_RANK = {"error": 0, "warning": 1, "inconclusive": 2}


def group(findings: list[Any], where: dict[str, dict[str, Any]] | None = None) -> list[Cause]:
    """The causes of ``findings`` (errors first, then by size), each listing its findings'
    indices in ``findings``. ``where``: hook name -> {function, file, line} (``locations``)."""
    by: dict[str, Cause] = {}
    said: dict[str, dict[str, set]] = {}  # key -> template word -> every value its findings gave
    named = _named(findings)
    joined: set[int] = set()
    order = sorted(range(len(findings)), key=lambda i: _get(findings[i], "kind") == KV_INVARIANT)
    for i in order:  # (the rules' causes first: the invariant's findings join them)
        f = findings[i]
        key, words = mechanism(f)
        if _get(f, "kind") == KV_INVARIANT:  # a rule that names the mechanism for the same request: its cause
            d = _get(f, "data") or {}
            hit = next((named[r] for r in (_get(f, "req"), d.get("p_req")) if r in named), None)
            if hit is not None and hit in by:
                by[hit].findings.append(i)
                by[hit].confirmed += 1
                joined.add(i)
                continue
        c = by.get(key)
        if c is None:
            c = by[key] = Cause(0, _get(f, "kind"), key, "", _get(f, "severity"), [])
        for w, v in words.items():
            said.setdefault(key, {}).setdefault(w, set()).update(x for x in v.split(",") if x)
        c.findings.append(i)
        sev = _get(f, "severity")
        if _RANK.get(sev, 2) < _RANK.get(c.severity, 2):
            c.severity = sev
        c.errors += sev == "error"
        c.warnings += sev == "warning"
        c.inconclusive += sev == "inconclusive"
        req, step, inst = _get(f, "req"), _get(f, "step"), _get(f, "inst")
        if req and req not in c.requests:
            c.requests.append(req)
        if isinstance(step, int):
            c.steps = [min(step, c.steps[0]), max(step, c.steps[1])] if c.steps else [step, step]
        if inst and inst not in c.instances:
            c.instances.append(inst)
    for key, c in by.items():
        title_t, hooks, ups = MECHANISMS.get(key.split(":", 1)[0], ("{title}", (), ()))
        vals = {w: sorted(v) for w, v in said.get(key, {}).items()}
        words = {w: ("/".join(v) if w != "title" else (v[0] if v else "")) for w, v in vals.items()}
        words["moves"] = "/".join(vals.get("move", [])) or "a move"
        try:
            c.title = title_t.format(**words)
        except (KeyError, IndexError):
            c.title = title_t
        hooks = [x for h in hooks for x in ([h.replace("{move}", m) for m in vals.get("move", [])]
                                            if "{move}" in h else [h])]
        c.where = _where(hooks, where or {})
        c.upstream = [f"{VLLM}/issues/{u}" for u in ups]
    out = sorted(by.values(), key=lambda c: (_RANK.get(c.severity, 2), -len(c.findings), c.mechanism))
    for n, c in enumerate(out, 1):
        c.n = n
        best = min([i for i in c.findings if i not in joined] or c.findings, key=lambda i: (_RANK.get(_get(findings[i], "severity"), 2),
                                              _get(findings[i], "step") if isinstance(_get(findings[i], "step"), int)
                                              else 1 << 60))
        c.first = {"index": best, "req": _get(findings[best], "req"), "step": _get(findings[best], "step"),
                   "title": str(_get(findings[best], "title") or "")}
    return out


def _named(findings: list[Any]) -> dict[str, str]:
    """request id -> the mechanism key of the first (worst) finding of another class about it, the
    request on either side of its P/D pair (a rule's finding may name P's request, the invariant's D's)."""
    out: dict[str, str] = {}
    for f in sorted(findings, key=lambda f: _RANK.get(_get(f, "severity"), 2)):
        if _get(f, "kind") == KV_INVARIANT:
            continue
        key = mechanism(f)[0]
        d = _get(f, "data") or {}
        for r in (_get(f, "req"), d.get("p_req"), d.get("d_req"), *(d.get("reqs") or ())):
            if isinstance(r, str) and r not in out:
                out[r] = key
    return out


def _where(hooks: Iterable[str], where: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for h in hooks:
        loc = where.get(h)
        if loc:
            out.append({"hook": h, **loc})
    return out


# ---------------------------------------------------------------------------------------
# where in vLLM: the trace's own record, else the releases' table
# ---------------------------------------------------------------------------------------

_TABLE: dict[str, Any] | None = None


def _table() -> dict[str, Any]:
    global _TABLE
    if _TABLE is None:
        path = os.path.join(os.path.dirname(__file__), "vllm_where.json")
        try:
            with open(path, encoding="utf-8") as fh:
                _TABLE = json.load(fh)
        except (OSError, ValueError):
            _TABLE = {}
    return _TABLE


def locations(status_events: Iterable[dict[str, Any]], vllm_version: str) -> dict[str, dict[str, Any]]:
    """hook name -> {function, file, line, source}: from the trace's ``hooks.status`` events
    (their ``where``, recorded as each hook was installed), else from ``vllm_where.json`` (the
    release's own code, read by scripts/vllm_where.py) for the recorded vLLM version; a hook in
    neither has no location."""
    out: dict[str, dict[str, Any]] = {}
    for e in status_events:
        for h, w in (e.get("where") or {}).items():
            if isinstance(w, str) and ":" in w and h not in out:
                path, _, rest = w.partition(":")
                line, _, fn = rest.partition(" ")
                if line.isdigit():
                    out[h] = {"function": fn, "file": path, "line": int(line), "source": "trace"}
    tab = _table()
    rel = (tab.get("releases") or {}).get((vllm_version or "").split("+")[0]) or {}
    for h, w in rel.items():
        if h not in out and isinstance(w, list) and len(w) == 3:
            out[h] = {"function": w[2], "file": w[0], "line": w[1], "source": "release table"}
    return out


def trace_locations(events: Iterable[dict[str, Any]], header: dict) -> dict[str, dict[str, Any]]:
    """``locations`` for a loaded trace: its hooks.status events and its header's vLLM version."""
    return locations((e for e in events if e.get("ev") == "hooks.status"), header_vllm(header))


def header_vllm(header: dict) -> str:
    return str((header.get("versions") or {}).get("vllm") or "")


def source_link(loc: dict[str, Any], vllm_version: str) -> str:
    """vLLM's source on GitHub at the recorded release's tag (main when the version is unknown)."""
    tag = f"v{vllm_version.split('+')[0]}" if vllm_version else "main"
    return f"{VLLM}/blob/{tag}/{loc['file']}#L{loc['line']}"


def where_text(c: Cause) -> str:
    return ", ".join(f"{w['file']}:{w['line']} ({w['function']})" for w in c.where)


def issue_refs(c: Cause) -> str:
    return ", ".join("#" + u.rsplit("/", 1)[-1] for u in c.upstream)
