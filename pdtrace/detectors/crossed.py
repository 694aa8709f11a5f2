"""kv-never-crossed (issue 51): a prompt P prefilled for D whose KV never reached D.

The costliest P/D failures raise nothing and give correct tokens: a router that drops
``kv_transfer_params`` (smg PR #1622: every decode worker recomputed the whole prefill), a load
that brought fewer tokens than P computed. Per request D's scheduler served, from vLLM's own
values as the hooks read them:

- D's request: its ``req.add`` (``kv``: whether it came with remote-prefill params, P's request
  id, the tokens P computed; ``prompt_hash`` / ``prompt_len``), and its first ``sched.alloc``
  (``num_new_computed_tokens``: D's own prefix-cache hit; ``num_external_computed_tokens``: the
  tokens the connector said it would load, ``get_num_new_matched_tokens``). D computes the rest
  of the prompt itself.
- P's request: its ``req.add`` with ``do_remote_decode`` (P prefilled it for a remote decode) and
  the tokens it computed (``req.finish``).

Findings (warnings: wasted work, the tokens are right):

- *prefill ran twice, no transfer params*: D served a request with no remote-prefill params whose
  prompt (hash and length) P prefilled for a remote decode (matched once each, in order: the
  params are gone, so the prompt is what ties them; the hash, never the text). P's side is a
  request with ``do_remote_decode`` on a scheduler that saves KV (kv_producer / kv_both), D's on
  one that loads it, on another instance: vLLM's own unit tests, recorded as one trace, send
  do_remote_decode requests to a kv_consumer and the same prompts to other schedulers;
- *prefill ran twice, nothing loaded* / *partial load*: D's request had the params, but its local
  hit plus what the connector loads fall a block or more short of what P computed; D computed the
  difference itself. A request whose load failed is the kv-load-failure-recovery class's (said in
  the facts, not flagged here).

Beside them, ``notes()``: the deployment's share of prompt tokens loaded from P, hit in D's own
prefix cache and computed on D, per instance pair (``check`` prints it as one line per pair).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .request_ids import BaseIndex, base_id
from .base import KV_NEVER_CROSSED, SEVERITY_ERROR, SEVERITY_WARNING, Finding
from .crossed_groups import add as add_groups
from .crossed_groups import groups_of, per_group
from .crossed_groups import notes as group_notes
from .index import feed_all, kind_code

Event = dict[str, Any]

_KINDS = ("req.add", "sched.alloc", "req.finish", "kvload.request", "nixl.remote_alloc", "nixl.lease_expired",
          "nixl.read")
LOADING_ROLES = frozenset({"kv_consumer", "kv_both"})
SAVING_ROLES = frozenset({"kv_producer", "kv_both"})
KEPT = 1 << 15  # open requests kept per side (the oldest go first)


class Stream:
    """Per D request (pid, request id) from its arrival to its finish; per P request prefilled
    for a remote decode, its prompt and tokens until a D request claims it."""

    KINDS = _KINDS

    def __init__(self, header: dict | None = None):
        self.configs: Any = None
        self.p_reqs: dict[str, dict] = {}  # P's request id -> {req, inst, prompt, tokens, id}: not yet claimed
        self.p_ids = BaseIndex(KEPT)  # ... by base id (D may name P's request by the router's id)
        self.p_by_prompt: dict[tuple, deque] = {}  # (prompt hash, len) -> the ids of those of p_reqs
        self.d_open: dict[tuple, dict] = {}  # (pid, D request) -> what it arrived with, its first allocation
        self.pairs: dict[tuple, dict] = {}  # (P inst, D inst) -> token counts (notes)
        self.expired: dict[str, Event] = {}  # P's request id -> its nixl.lease_expired (not yet matched to a read)
        self.reads: dict[str, Event] = {}  # P's request id -> D's first nixl.read of it (not yet matched)
        self.findings: list[Finding] = []

    def _config(self, e: Event) -> dict:
        """The sched.config of the scheduler that emitted ``e`` (empty where none is known)."""
        return (self.configs.config_of(e) if self.configs is not None else None) or {}

    @staticmethod
    def _role(c: dict) -> str:
        return str(c.get("kv_role") or "")

    @staticmethod
    def _draft_left(c: dict) -> list[tuple[int, list]]:
        """The drafter's KV cache groups (vLLM's own mark, ``draft_groups``) that are not among the transfer groups
        (``transfer_group_ids``, recorded where not every group transfers) of scheduler config ``c``, with their layer
        names. HiSparse's hot / resident groups, which D derives from a transferred group, are not the drafter's."""
        tg, draft = c.get("transfer_group_ids"), c.get("draft_groups")
        if tg is None or not draft:
            return []
        kinds, layers = c.get("group_kinds") or [], c.get("draft_layers") or []
        return [(int(g), list(layers[i]) if i < len(layers) else []) for i, g in enumerate(draft)
                if g not in tg and not str(kinds[g] if g < len(kinds) else "").startswith("HiSparse")]

    @staticmethod
    def _block(c: dict) -> int:
        sizes = c.get("block_sizes") or [16]
        return int(max(sizes))

    def feed(self, idx: Any) -> None:
        self.configs = idx.configs
        ADD, ALLOC, FINISH, KVREQ, RALLOC, EXPIRED, READ = (kind_code(k) for k in _KINDS)
        for e, k in zip(*idx.ordered_codes(_KINDS)):
            if k == ADD:
                self._add(e)
            elif k == ALLOC:
                d = self.d_open.get((e.get("pid"), e.get("req")))
                if d is not None and d["local"] is None and "num_external_computed_tokens" in e:
                    d["local"] = int(e.get("num_new_computed_tokens") or 0)
                    d["ext"] = int(e.get("num_external_computed_tokens") or 0)
                    d["step"] = e.get("step")
                    d["ids"].append(e.get("id"))
            elif k == FINISH:
                p = self.p_reqs.get(str(e.get("req")))
                if p is not None and p["inst"] == e.get("inst") and p["tokens"] is None:
                    p["tokens"] = e.get("num_computed_tokens")
                d = self.d_open.pop((e.get("pid"), e.get("req")), None)
                if d is not None:
                    self._judge(d)
            elif k == RALLOC:
                d = self.d_open.get((e.get("pid"), e.get("req")))
                if d is not None and d.get("alloc") is None:  # the blocks its connector loads into, per group
                    d["alloc"] = {x: e.get(x) for x in ("load_block_ids", "local_block_ids")}
            elif k == EXPIRED or k == READ:
                self._lease(e, k == EXPIRED)
            elif k == KVREQ:
                d = self.d_open.get((e.get("pid"), e.get("req")))
                if d is not None:  # where the rollback left its computed tokens: what stays loaded
                    d["failed_load"] = True
                    kept = 0 if e.get("action") == "fail" else int(e.get("computed") or 0)
                    d["errored"] = d.get("errored") or e.get("action") == "fail"  # (vLLM ends it FINISHED_ERROR)
                    d["kept"] = kept if d.get("kept") is None else min(d["kept"], kept)

    def _add(self, e: Event) -> None:
        kv = e.get("kv") or {}
        req = str(e.get("req"))
        prompt = (e.get("prompt_hash"), e.get("prompt_len"))
        c = self._config(e)
        if kv.get("do_remote_decode"):
            if self._role(c) not in SAVING_ROLES:
                return  # (a request for a remote decode on an instance that saves no KV: vLLM's own tests)
            if len(self.p_reqs) >= KEPT:
                self._drop(next(iter(self.p_reqs)))
            self.p_ids.add(req)
            self.p_reqs[req] = {"req": req, "inst": e.get("inst"), "prompt": prompt, "tokens": None,
                                "id": e.get("id")}
            if prompt[0] is not None:
                self.p_by_prompt.setdefault(prompt, deque()).append(req)
            return
        if self._role(c) not in LOADING_ROLES:
            return
        if len(self.d_open) >= KEPT:
            self._judge(self.d_open.pop(next(iter(self.d_open))))
        self.d_open[(e.get("pid"), e.get("req"))] = {
            "req": req, "inst": e.get("inst"), "prompt": prompt, "len": int(e.get("prompt_len") or 0),
            "params": bool(kv.get("do_remote_prefill")), "remote_req": kv.get("remote_request_id"),
            "remote_tokens": kv.get("remote_num_tokens"), "local": None, "ext": None, "step": e.get("step"),
            "failed_load": False, "block": self._block(c), "ids": [e.get("id")], "draft_left": self._draft_left(c),
            "cfg": c, "alloc": None}

    def _drop(self, req: str) -> dict | None:
        """Forget P's request ``req`` (claimed, or the oldest when KEPT are held): both indexes."""
        p = self.p_reqs.pop(req, None)
        q = self.p_by_prompt.get(p["prompt"]) if p is not None else None
        if q is not None:
            q.remove(req)
            if not q:
                del self.p_by_prompt[p["prompt"]]
        return p

    def _claim(self, d: dict) -> dict | None:
        """P's request for ``d`` (taken out of the unclaimed ones): the one its params name, else
        the oldest unclaimed P request of the same prompt (hash and length) on another instance."""
        if d["remote_req"] is not None:
            req = str(d["remote_req"])
        else:
            q = self.p_by_prompt.get(d["prompt"]) or ()
            req = q[0] if q else None
        if req is not None and req not in self.p_reqs and base_id(req) == req:  # (P's own id where D's params name
            req = self.p_ids.match(req, self.p_reqs) or req                       # the router's)
        p = self.p_reqs.get(req) if req is not None else None
        if p is None or p["inst"] == d["inst"]:
            return None  # (same instance: kv_both everywhere, no --instance: the sides are not told apart)
        return self._drop(req)

    def _judge(self, d: dict) -> None:
        if d["local"] is None:
            return  # never allocated (aborted while waiting): nothing computed either way
        p = self._claim(d)
        n, local, ext = d["len"], d["local"], d["ext"]
        computed = max(n - local - ext, 0)
        # P's instance; "?" for a request with params whose P request is not in the trace (D's alone)
        p_inst = p["inst"] if p else ("?" if d["params"] else None)
        pair = self._pair(p_inst, d["inst"])
        pair["requests"] += 1
        pair["prompt_tokens"] += n
        # a failed load keeps what the rollback left below its computed tokens; the rest is recomputed on D
        kept = ext if not d["failed_load"] else max(0, min(ext, int(d.get("kept") or 0) - local))
        pair["loaded"] += kept
        if d.get("errored"):  # policy "fail": the request ended in error, nothing was recomputed
            pair["load_failed_error_tokens"] = pair.get("load_failed_error_tokens", 0) + ext - kept
        else:
            pair["load_failed_tokens"] += ext - kept
        pair["local_hit"] += local
        pair["computed"] += computed
        pair["no_params"] += not d["params"]
        pair["failed_load_requests"] += d["failed_load"]
        groups = groups_of(d["cfg"])
        add_groups(pair.setdefault("groups", {}), groups, per_group(groups, d["cfg"], d["alloc"], local, kept))
        if d["draft_left"] and d["params"] and ext > 0 and not d["failed_load"]:
            self._drafter_left(pair, d, p, ids=[i for i in ((p or {}).get("id"), *d["ids"]) if i is not None])
        if p is None or d["failed_load"]:
            return
        p_tokens = d["remote_tokens"] if d["remote_tokens"] is not None else p["tokens"]
        ids = [i for i in (p.get("id"), *d["ids"]) if i is not None]
        base = {"p_req": p["req"], "d_req": d["req"], "p_inst": p["inst"], "prompt_len": n, "local_hit": local,
                "loaded": ext, "computed_on_d": computed, "p_tokens": p_tokens, "params": d["params"]}
        if not d["params"]:
            self._flag(pair, d, ids,
                f"prefill ran twice: {d['req']} reached D without kv_transfer_params, and D computed {computed} of "
                f"its {n} prompt tokens itself",
                f"P prefilled this prompt for a remote decode ({p['req']} on {p['inst']}, the same prompt hash and "
                f"length), but the request D served carried no remote-prefill params, so D's connector loaded "
                f"nothing (0 external tokens) and D prefilled the prompt again: {computed} token(s) computed on D"
                + (f", {local} from its own prefix cache" if local else "") + ". The output is still right; the "
                f"work P did is wasted and P's blocks wait for a read that never comes. Whatever sits between P "
                f"and D (a router, a proxy) dropped the kv_transfer_params P returned (the shape of smg PR #1622).",
                {**base, "mechanism": "no-params"})
            return
        if not p_tokens:
            return
        missing = min(int(p_tokens), n) - local - ext
        if missing < d["block"]:
            return
        what = "nothing loaded" if ext == 0 else "partial load"
        self._flag(pair, d, ids,
            f"{'prefill ran twice' if ext == 0 else 'partial load'}: D loaded {ext} of the {p_tokens} prompt "
            f"tokens P computed for {d['req']} and computed {computed} itself",
            f"P computed {p_tokens} prompt token(s) for this request ({p['req']} on {p['inst']}) and D received its "
            f"transfer params, but D's connector said it would load {ext} token(s) (get_num_new_matched_tokens) "
            f"beyond D's own prefix-cache hit of {local}: {missing} token(s) P had computed were computed again "
            f"on D. No load failure is recorded for it (that would be the kv-load-failure-recovery class's).",
            {**base, "mechanism": what.replace(" ", "-"), "missing": missing})

    def _drafter_left(self, pair: dict, d: dict, p: dict | None, ids: list) -> None:
        """vLLM #54926's shape: D loads the prompt into the transfer groups only, its scheduler counts the loaded
        tokens computed for every group, so the drafter's group holds blocks no transfer and no forward on D wrote."""
        local, ext = d["local"], d["ext"]
        pair["drafter_unwritten"] = pair.get("drafter_unwritten", 0) + ext
        groups = ", ".join(f"{g} ({', '.join(ls) or 'layers not recorded'})" for g, ls in d["draft_left"])
        self._flag(pair, d, ids,
            f"drafter KV never crossed: D loaded {ext} prompt token(s) of {d['req']} into the target's groups only; "
            f"the drafter's group {', '.join(str(g) for g, _ in d['draft_left'])} got none of them",
            f"D's scheduler has the drafter's KV cache group(s) {groups} outside its transfer groups "
            f"(KVCacheConfig.transfer_group_ids), so the connector loads P's KV into the other groups only. The "
            f"scheduler still counts the {ext} loaded token(s) computed for every group (positions {local}-"
            f"{local + ext - 1}; get_num_new_matched_tokens, allocate_slots), and D computes only the prompt "
            f"tokens it did not load ({max(d['len'] - local - ext, 0)}): the drafter attends to blocks of its own "
            f"group that no transfer and no forward on D ever wrote. The target's tokens stay right (it verifies "
            f"every draft); what the drafter proposes is built on garbage, so acceptance falls (vLLM #54926: "
            f"draft-model groups left out of NIXL's transfer groups).",
            {"p_req": (p or {}).get("req"), "d_req": d["req"], "p_inst": (p or {}).get("inst"),
             "prompt_len": d["len"], "local_hit": local, "loaded": ext, "mechanism": "drafter-group",
             "groups": [g for g, _ in d["draft_left"]], "layers": [[g, ls] for g, ls in d["draft_left"]],
             "unwritten": [local, local + ext]},
            severity=SEVERITY_ERROR)

    def _lease(self, e: Event, expired: bool) -> None:
        """P's lease on a request ran out (nixl.lease_expired) and D read that request's blocks (nixl.read naming it as
        remote_req), the two in either order in the trace (a merged trace orders them by possibly skewed clocks): P
        releases at the expiry only requests whose reads it has not all been told of (each D rank sends a notice
        when its read completes), so a read of an expired request is one that ended after the release, or whose
        notice was still in flight (a narrow window, flagged too: the finding says so)."""
        p_req = str(e.get("req") if expired else e.get("remote_req") or "")
        if not p_req:
            return
        mine, other = (self.expired, self.reads) if expired else (self.reads, self.expired)
        key = base_id(p_req)  # (D may name P's request by the router's id: request_ids)
        if key in mine:
            return  # (D reads a request once per TP rank / region: the first says it)
        match = other.pop(key, None)
        if match is None:
            if len(mine) >= KEPT:
                mine.pop(next(iter(mine)))
            mine[key] = {x: e.get(x) for x in ("id", "inst", "req", "step", "remote_block_ids", "retrieved",
                                                 "remote_engine", "engine", "w")}
            return
        exp, rd = (e, match) if expired else (match, e)
        p_req = str(exp.get("req") or p_req)  # (P's own id)
        blocks = [b for g in rd.get("remote_block_ids") or [] for b in g]
        gap = (rd["w"] - exp["w"]) / 1e9 if isinstance(rd.get("w"), int) and isinstance(exp.get("w"), int) else None
        when = (f" D's read was issued {gap:.2f} s after P's lease ran out (by the trace's clocks)." if gap and gap > 0
                else "")
        got = int(exp.get("retrieved") or 0)
        pair = self._pair(exp.get("inst"), rd.get("inst"))
        d = {"req": str(rd.get("req")), "step": rd.get("step"), "inst": rd.get("inst")}
        self._flag(pair, d, [i for i in (exp.get("id"), rd.get("id")) if i is not None],
            f"D read KV P had already released: P's lease on {p_req} ran out before D's read, so D loaded "
            f"{len(blocks)} block(s) that P had freed for other requests",
            f"P held the blocks of {p_req} for a decode worker under a lease (NIXL's kv_lease_duration, 30 s by "
            f"default; D's heartbeats extend it only for requests D has already received), and it ran out with "
            f"{got} read-completion notice(s) from D counted (nixl.lease_expired: _reap_expired_send_leases; P's log: "
            f"\"Releasing expired KV blocks for request {p_req} which were retrieved by {got} remote worker(s)\"), "
            f"so P's scheduler freed the blocks for other requests.{when} D's read of them ended "
            f"after the release" + ("" if gap and gap > 0 else " (or its notice was still on its way: a read that "
                                    "ended just before the release is flagged too)") + f", and vLLM does not fail "
            f"it: P only logs "
            f"\"Potentially invalid KV blocks for unrecognized request\" and D decodes on whatever the blocks "
            f"{blocks[:8]} held by then: another "
            f"request's KV, HTTP 200 (vLLM #52234: the previous prompt's answer returned for a new prompt; "
            f"aws-samples/aws-do-eks PR #84: 8 of 42 requests). A request reaches D that late when whatever sits "
            f"between P and D (a router, a queue) holds it longer than the lease.",
            {"p_req": p_req, "d_req": d["req"], "p_inst": exp.get("inst"), "mechanism": "expired-lease",
             "remote_blocks": blocks, "retrieved": got, "read_after_s": gap}, severity=SEVERITY_ERROR)

    def _pair(self, p_inst: Any, d_inst: Any) -> dict:
        return self.pairs.setdefault((p_inst, d_inst), {
            "p_inst": p_inst, "d_inst": d_inst, "requests": 0, "prompt_tokens": 0, "loaded": 0, "local_hit": 0,
            "computed": 0, "load_failed_tokens": 0, "no_params": 0, "failed_load_requests": 0, "flagged": 0})

    def _flag(self, pair: dict, d: dict, ids: list, title: str, why: str, data: dict,
              severity: str = SEVERITY_WARNING) -> None:
        pair["flagged"] += 1
        self.findings.append(Finding(KV_NEVER_CROSSED, severity, d["req"], d["step"], d["inst"], ids, title,
                                     why, data))

    def finish(self) -> list[Finding]:
        for d in list(self.d_open.values()):
            self._judge(d)  # (still running when the trace ends: its prefill is done or not begun)
        self.d_open = {}
        out, self.findings = self.findings, []
        return out

    def notes(self) -> list[dict]:
        """Per instance pair (P's instance: None for requests with no params and no P request of
        their prompt, "?" for requests with params whose P request is not in the trace; D's):
        requests, prompt tokens, loaded from P (for a failed load, what its rollback kept),
        hit in D's prefix cache, computed on D at admission, ``drafter_unwritten`` (loaded tokens that no transfer
        put into the drafter's own KV cache group: absent when none), ``load_failed_tokens`` (planned to
        load, lost to a failed load and recomputed on D; ``failed_load_requests``), ``load_failed_error_tokens``
        (lost to a failed load under kv_load_failure_policy "fail": the request ended in error; absent when
        none), how many
        arrived without params, and how many were flagged. ``loaded + load_failed_tokens +
        load_failed_error_tokens`` is what D's connector planned at admission (vLLM's ``external_kv_transfer`` counter).
        ``groups``: per KV cache group of D, how many of the loaded tokens reached it
        (``crossed_groups``)."""
        return [{**p, "groups": group_notes(p.get("groups") or {})} for p in self.pairs.values()]


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


def pair_notes(events: list[Event]) -> list[dict]:
    """``Stream.notes`` over ``events`` (the report and the viewer, which hold the events)."""
    st = Stream()
    feed_all(st, events)
    return st.notes()


def summary_line(n: dict) -> str:
    """One pair's note in words (``check``)."""
    total = n["prompt_tokens"] or 1
    pct = lambda x: f"{100 * x / total:.0f}%"  # noqa: E731
    short = any(g.get("not_transferred") or g.get("not_loaded") for g in n.get("groups") or ())
    out = (f"{pair_name(n)}: {n['requests']} request(s), {n['prompt_tokens']} prompt tokens: {pct(n['loaded'])} "
           f"loaded from P" + (" (not into every KV cache group: per group below)" if short else "")
           + f", {pct(n['local_hit'])} D's prefix cache, {pct(n['computed'])} computed on D"
           + (f", {pct(n['load_failed_tokens'])} recomputed after a failed load (kv-load-failure-recovery)"
              if n.get("load_failed_tokens") else "")
           + (f", {pct(n['load_failed_error_tokens'])} lost to a failed load (the request ended in error: "
              f"kv_load_failure_policy fail)" if n.get("load_failed_error_tokens") else ""))
    extra = [f"{n['no_params']} without transfer params" if n["no_params"] else "",
             f"{n['failed_load_requests']} with a failed load" if n["failed_load_requests"] else "",
             f"{n['flagged']} flagged: see the findings" if n.get("flagged") else ""]
    extra = [x for x in extra if x]
    drafter = (f"; the drafter's own KV cache group got none of the {n['drafter_unwritten']} loaded tokens "
               f"(it is not a transfer group)" if n.get("drafter_unwritten") and len(n.get("groups") or ()) < 2
               else "")  # (with its groups recorded, their lines under this one say it)
    return out + (f" ({'; '.join(extra)})" if extra else "") + drafter


def pair_name(n: dict) -> str:
    """``P -> D``; ``D alone (no P request of the prompt)``; ``(P not in the trace) -> D``."""
    if n["p_inst"] is None:
        return f"{n['d_inst']} alone (no P request of the prompt)"
    return f"{'(P not in the trace)' if n['p_inst'] == '?' else n['p_inst']} -> {n['d_inst']}"


def short_line(n: dict) -> str:
    """One pair's note in a few words (the viewer's findings list): the requests without params
    and the share computed on D first."""
    total = n["prompt_tokens"] or 1
    src = (f"{n['d_inst']} alone" if n["p_inst"] is None else
           f"{'P?' if n['p_inst'] == '?' else n['p_inst']}->{n['d_inst']}")
    noparams = f", {n['no_params']} without params" if n["no_params"] else ""
    drafter = "; drafter group not loaded" if n.get("drafter_unwritten") else ""
    return (f"{src}: {n['requests']} req{noparams}; {100 * n['computed'] / total:.0f}% computed on D, "
            f"{100 * n['loaded'] / total:.0f}% loaded, {100 * n['local_hit'] / total:.0f}% D cache{drafter}")
