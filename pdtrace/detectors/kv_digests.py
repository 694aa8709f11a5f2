"""The KV model's byte check (issue 60, ``pdtrace record --kv-checksum``; ``kv_model.Model`` takes
``_kv_digest`` from ``Digests``): D's digest of a block it loaded, taken before its first forward, against P's
digest of the block the transfer read, taken when P's request was final. A block whose bytes differ is a KV read
that is not the request's own whatever the model says; where the model names a mechanism for that request the
digest finding carries it (one bug, one cause), else ``digest-differs``."""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]
KEPT = 1 << 12  # P requests' digests and D's comparisons waiting for them (the oldest go first)


def _flat(blocks: Any) -> dict[tuple[int, int], int]:
    """{"group": {"block": digest}} -> {(group, block): digest}. By group: P's worker lists still name the blocks
    vLLM pruned from a sliding window, which the pool may since have given to another group."""
    out = {}
    for g, d in (blocks or {}).items():
        for b, v in (d or {}).items():
            out[(int(g), int(b))] = v
    return out


class Digests:
    """(a mixin of ``kv_model.Model``: it reads ``landed``, ``req_of``, ``scheds``, ``p_ids``, ``p_of``, ``counts``
    and ``report``, and the mechanism its reads gave a request: ``mech_of``)."""

    def _kv_digest_setup(self, e: Event) -> None:
        st = self.digest_setup.setdefault(e.get("inst"), {"every": 1, "skipped": [], "layers": 0, "layout": set()})
        st["every"] = max(st["every"], int(e.get("every") or 1))
        if e.get("layout"):
            st["layout"].add(str(e["layout"]))
        st["layers"] += int(e.get("layers") or 0)
        st["skipped"] += [x for x in e.get("skipped") or () if x not in st["skipped"]][:8]

    def digest_notes(self) -> dict:
        """What the byte check compared and what it could not: for the coverage line."""
        every = max((st["every"] for st in self.digest_setup.values()), default=1)
        skipped = [f"{i}: {x}" for i, st in self.digest_setup.items() for x in st["skipped"]]
        sliding = sorted({g for s in self.scheds.values() for g, w in enumerate(s.cfg.get("windows") or ()) if w})
        return {"setup": bool(self.digest_setup), "every": every, "requests": self.digest_reqs, "sliding": sliding,
                "apart": sorted(self.digest_apart)[:4],
                "transfers": self.counts["transfers"], "no_p": sum(len(v) for v in self.d_waiting.values()),
                "skipped": skipped[:4], "no_layers": sorted(str(i) for i, st in self.digest_setup.items()
                                                             if not st["layers"])}

    def _kv_digest(self, e: Event) -> None:
        if e.get("side") == "P":
            rid = str(e.get("req"))
            self.p_digests[rid] = (_flat(e.get("blocks")), e.get("id"))
            if len(self.p_digests) > KEPT:
                del self.p_digests[next(iter(self.p_digests))]
            for waiting in self.d_waiting.pop(rid, ()):
                self._compare(*waiting, rid)
            return
        x = self.landed.get((e.get("pid"), str(e.get("req"))))
        r = self.req_of(e)
        if x is None or r is None or x.get("landed") != "DONE":
            return  # (D's own prefix-cache hit, its read not in the trace, or a failed load: nothing crossed whole)
        p_req = str(x["p_req"]) if x.get("p_req") is not None else None
        if p_req is not None and p_req not in self.p_digests:
            p_req = self.p_ids.match(p_req, self.p_digests) or p_req
        if p_req is None or p_req not in self.p_digests:
            self.d_waiting.setdefault(str(p_req), []).append((r, x, _flat(e.get("blocks")), e))
            if len(self.d_waiting) > KEPT:
                del self.d_waiting[next(iter(self.d_waiting))]
            return
        self._compare(r, x, _flat(e.get("blocks")), e, p_req)

    def _compare(self, r: Any, x: dict, d: dict, e: Event, p_req: str) -> None:
        """D's digests ``d`` of the blocks its read ``x`` filled against P's digests of ``p_req`` (the id P's
        digest event named: the exact one or its base-id match)."""
        p, p_ev = self.p_digests[p_req]
        s = self.scheds.get(r.sched)
        lp = self.digest_setup.get(x.get("p"), {}).get("layout") or set()
        ld = self.digest_setup.get(s.inst if s is not None else None, {}).get("layout") or set()
        if lp and ld and lp != ld:  # (other layers, dtype, block shape or TP size: the digests mean other bytes)
            self.digest_apart.add(f"{x.get('p')}: {' | '.join(sorted(lp))} against {s.inst}: {' | '.join(sorted(ld))}")
            return
        bad = []
        read = x["read"]
        push = bool(x.get("push"))
        local = read.get("local_out" if push else "local_block_ids") or []
        remote = read.get("remote_out" if push else "remote_block_ids") or []
        p_lists = x.get("p_lists")
        for g, (lg, rg) in enumerate(zip(local, remote)):
            at: dict[int, int] = {}  # D's block -> its (first) token position in D's list
            for i, b in enumerate(r.blocks[g] if g < len(r.blocks) else ()):
                at.setdefault(b, i)
            theirs = p_lists[g] if p_lists and g < len(p_lists) else None
            for lb, rb in zip(lg, rg):
                # the same token position on both sides: D's token block i against P's token block i (vLLM's own
                # lists); the block the read took stands in where P's list is not in the trace
                pb = rb
                if theirs is not None and lb in at:
                    i = at[lb]
                    pb = theirs[i] if i < len(theirs) and theirs[i] else None
                if pb is None or (g, lb) not in d or (g, pb) not in p:
                    continue
                self.digest_counts[g] = self.digest_counts.get(g, 0) + 1
                if d[(g, lb)] != p[(g, pb)]:
                    bad.append((g, lb, pb, d[(g, lb)], p[(g, pb)], rb))
        self.digest_reqs += 1
        if bad and s is not None:
            self.report("digest", s, r, e=e, bad=bad, p_req=x["p_req"], p_ev=p_ev, mech=self.mech_of(s, r))
