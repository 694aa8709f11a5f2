"""The KV model's reads (``kv_model.Model`` takes ``reads`` from ``Reads``): where a step attends to KV, the
request's dirty blocks against what they hold (the invariant), its window's positions against vLLM's null block."""

from __future__ import annotations

from typing import Any

from .kv_state import Req, Sched, _unjudged

Event = dict[str, Any]


class Reads:
    """``reads`` (a mixin of ``kv_model.Model``: it reads ``blocks``, ``ambiguous``, ``counts``, ``same`` and
    ``report``, and keeps ``_read_own`` of the transfers)."""

    def reads(self, s: Sched, r: Req, c: int, e: Event) -> None:
        """Step ``e`` reads positions before ``c`` of request ``r``: check its dirty blocks."""
        if not r.dirty or c <= 0:
            return
        bad = []
        group = s.group
        # the window's start by the most tokens the request may have computed: after a step with drafts and before
        # its next allocation the trace knows only c (none accepted) .. r.upto (all); vLLM prunes by its own count,
        # so a position only the fewest-accepted case reads is not read for certain (a live Gemma 3 + ngram run:
        # vLLM freed a block by 2 accepted drafts and the check read it by none)
        hi_c = max(c, r.upto)
        for (g, b), i in list(r.dirty.items()):
            attn, bs, win, kind = group(g)
            if not attn:
                del r.dirty[(g, b)]  # a state group's block is not token-indexed (one block id pool: another
                continue             # group's write may land on a block id this one held before)
            start = 0
            if win and "Chunked" in kind:
                start = c - c % win
            elif win:
                start = max(0, hi_c - win + 1)
            if i * bs >= c:
                continue  # not read yet: stays dirty
            del r.dirty[(g, b)]
            if not win and ("SlidingWindow" in kind or "ChunkedLocal" in kind):
                # which positions its attention reads is the window's, not recorded (before sched.config.windows):
                # blocks before it are freed and handed on by vLLM itself
                self.counts["unjudged"] += 1
                self.report("unjudged", s, r, e=e, why=f"{kind} group without its window recorded (sched.config "
                                                       f"windows: recorded by pdtrace since its per-group facts)")
                continue
            if (i + 1) * bs <= start:
                continue  # out of the window: never read again
            lo, hi = max(start - i * bs, 0), min(c - i * bs, bs)
            blk = s.blocks.get(b)
            self.counts["reads"] += 1
            if blk is None:
                self.counts["unjudged"] += 1
                continue
            parts = [(blk.label, blk.lo, blk.hi, max(lo, blk.lo), hi)]
            if lo < blk.lo and blk.under is not None:  # the positions below a write that began mid-block
                ul, _how, _ev, _src, ulo, uhi = blk.under
                parts = [(ul, ulo, uhi, lo, min(hi, blk.lo)), *parts]
            why = ""
            for x in parts:
                if type(x[0]) is not tuple:
                    why = _unjudged(s, r, x[0])
                    if why:
                        break
            if (self.ambiguous and s.key[:2] in self.ambiguous) or (blk.src is not None and blk.src.ambiguous):
                why = ("two schedulers of one instance in one process, built before either ran a request: the "
                       "scheduler events do not say which emitted them")
            if not why and r.key is None:
                why = "no req.add: the request's prompt is not in the trace"
            if why:
                self.counts["unjudged"] += 1
                self.report("unjudged", s, r, e=e, why=why)
                continue
            exp = (r.key, g, i)
            if all(self.same(lab, exp) and blo <= a and bhi >= z for lab, blo, bhi, a, z in parts if a < z):
                if blk.src is not None:
                    self._read_own(blk.src)
                continue
            bad.append((g, b, i, lo, hi, blk))
        for g, lst in enumerate(r.blocks):  # a window's positions vLLM pruned to its null block while still read
            _attn, bs, win, kind = group(g)
            if not win or not lst:
                continue
            start = c - c % win if "Chunked" in kind else max(0, hi_c - win + 1)
            i0, i1 = start // bs, min((c - 1) // bs, len(lst) - 1)
            if i0 <= i1 and 0 in lst[i0:i1 + 1]:
                i = lst.index(0, i0, i1 + 1)
                self.counts["reads"] += 1
                if i == i0 and 0 not in lst[i0 + 1:i1 + 1] and (i0 + 1) * bs - start <= 1:
                    # one position at the window's leading edge: vLLM pruned by the count before it recomputes a
                    # fully loaded prompt's last token (num_computed_tokens - 1). By vLLM's own window rule the
                    # recomputed token reads it; whether the kernel's window reaches it is the backend's: a fact
                    self.counts["edge"] += 1
                    continue
                bad.append((g, 0, i, max(start - i * bs, 0), min(c - i * bs, bs), None))
        if bad:
            self.report("read", s, r, e=e, bad=bad, computed=c)
