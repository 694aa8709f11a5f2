"""D's prompt one token longer than P's: a proxy that appends P's first sampled token (vLLM #50558).

vLLM's NIXL toy proxy was changed (PR #50559) to hand the decoder the prefiller's first sampled
token as part of the prompt. D then asks for one token more than P computed. vLLM #50558 (a fix
proposed, not merged in 0.32.0 / 0.33.0) names the two outcomes in D's worker:

- the prompt ends on a block boundary and D has no prefix-cache hit: D allocates one block more
  than P reported and ``_apply_prefix_caching`` asserts (``num_decode_blocks <= len(prefill)``);
- D has a prefix-cache hit: the trim pairs D's blocks by count from the end of P's list, one
  block off: D's blocks read the KV of the tokens one block earlier (silent).

What is real: P's and D's ``Scheduler`` with the NIXL connector's scheduler side
(``pd_harness``), D's own prefix cache (warmed by decoding the prompt's first blocks on D), and
the release's own ``_apply_prefix_caching`` on the lists D's connector metadata carries. Not run:
the read itself (no KV moves). The "proxy" is one line here: D's request gets P's prompt plus the
token P sampled, as PR #50559's proxy sends it.

The oracle is vLLM's own lists: D's block list for the request (where each block D loads into
sits) against P's reported blocks (token block i is P's block i), and whether the trim raised.
"""

from __future__ import annotations

import dataclasses
import itertools

from .pd_harness import PDConfig, make_pair, recording
from .pd_nixl import _trim, _worker_for_trim
from .kv_load_sim import run_events
from .pd_steps import _make_request, _step, p_prefill

_ids = itertools.count(1)
FIRST_TOKEN = 100  # the token P samples (pd_steps.p_prefill feeds it)


@dataclasses.dataclass
class Appended:
    events: list[dict]  # the pair's setup events and this run's, ids assigned in order
    p_req: str
    d_req: str
    prompt_len: int
    d_blocks: list[int]  # D's whole list for the request when it allocated (group 0)
    d_local: list[int]  # the blocks D loads into (connector metadata: the unhashed suffix)
    p_reported: list[int]  # P's remote_block_ids (group 0)
    trim_local: list[int] | None  # the trim's output: d[i] <- p[i] (None when it raised)
    trim_remote: list[int] | None
    raised: str | None  # the trim's exception, 'Type: message'
    block_size: int = 16

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == kind]

    def misplaced(self) -> list[tuple[int, int, int | None]]:
        """(D block, P block it reads, P block holding its tokens) for every pair that is off, from
        the lists alone: D's block at index i of its list holds token block i, and so does P's
        block at index i of its report, for the ``ceil(prompt_len / B)`` blocks P computed tokens
        into (None: P computed none of those tokens)."""
        if self.trim_local is None or self.trim_remote is None:
            return []
        held = -(-self.prompt_len // self.block_size)
        out = []
        for d, p in zip(self.trim_local, self.trim_remote):
            i = self.d_blocks.index(d)
            want = self.p_reported[i] if i < min(held, len(self.p_reported)) else None
            if want != p:
                out.append((d, p, want))
        return out

    def past_p(self) -> list[int]:
        """D's blocks to load that sit past the blocks P computed tokens into (D's list index)."""
        held = -(-self.prompt_len // self.block_size)
        return [b for b in self.d_local if self.d_blocks.index(b) >= held]


def appended_first_token(cfg: PDConfig = PDConfig(spec_method=""), prompt_len: int = 64, *,
                         d_cached_blocks: int = 0, append: bool = True) -> Appended:
    """P prefills ``prompt_len`` tokens; D gets the prompt plus P's first token (``append``), after
    decoding the prompt's first ``d_cached_blocks`` blocks itself (its prefix cache)."""
    pair = make_pair(cfg)
    rec = pair.rec
    n = next(_ids)
    p_req, d_req = f"app-{n}-P", f"app-{n}-D"
    prompt = [700 + (n * 53 + i) % 2000 for i in range(prompt_len)]
    B = cfg.block_size
    rec.flush()
    start = len(rec.events or [])
    with recording(rec):
        rec.emit("mark", label="scenario", sim=True,
                 detail=f"prompt_append {cfg.label()} prompt_len={prompt_len} d_cached_blocks={d_cached_blocks} "
                        f"append={append}")
        if d_cached_blocks:  # D decodes the prompt's first blocks itself: they stay in its prefix cache
            warm = f"app-{n}-warm"
            pair.d.add_request(_make_request(warm, prompt[:d_cached_blocks * B], 1, None, B))
            for _ in range(4):
                _step(pair.d, warm, 7)
                if warm not in pair.d.requests:
                    break
        params = p_prefill(pair.p, p_req, prompt, B)
        d_prompt = prompt + ([FIRST_TOKEN] if append else [])  # what PR #50559's proxy sends D
        pair.d.add_request(_make_request(d_req, d_prompt, 4, dict(params), B))
        out = pair.d.schedule()
        rmeta = out.kv_connector_metadata.reqs_to_recv[d_req]
        local = [list(g) for g in rmeta.local_block_ids]
        remote = [list(g) for g in rmeta.remote.block_ids]
        d_blocks = [list(g) for g in pair.d.kv_cache_manager.get_block_ids(d_req)]
        worker = _worker_for_trim(cfg, pair.d.kv_cache_config)
        worker._pdtrace_cur_req = d_req
        raised = None
        try:
            tl, tr = _trim(worker, local, remote)
            trim_local, trim_remote = list(tl[0]), list(tr[0])
        except Exception as exc:  # vLLM's own assertion: reported, not hidden
            raised = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # (as nixl.trim says it)
            trim_local, trim_remote = None, None
    rec.flush()
    events = run_events(pair, start)
    return Appended(events, p_req, d_req, prompt_len, d_blocks[0], local[0], remote[0], trim_local, trim_remote,
                    raised, B)


__all__ = ["Appended", "appended_first_token"]
