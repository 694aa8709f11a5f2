"""What each pane shows, computed from a ``TraceIndex`` (no Textual imports).

Every function here takes the index (and the selection) and returns plain dataclasses;
the widgets only turn them into text. Events are parsed on demand through the index,
so a pane costs the events it shows, not the trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdtrace.detectors import crossed_groups
from pdtrace.detectors.index import is_attention_group
from pdtrace.detectors.transfer_lists import NULL_BLOCK, is_tail_group
from pdtrace.index.trace_index import TraceIndex
from pdtrace.tracefile.trace import derive_block_lists

from . import model_kvload
from .model_acc import ACC_KINDS, BATCH_KINDS, AccRow, AccView, RowTracker, acc_insts, accepted  # noqa: F401

NIXL_KINDS = ("nixl.request_finished", "nixl.remote_alloc", "nixl.trim", "nixl.read")
META_KINDS = ("kvmeta.bind", "kvmeta.clear", "kvmeta.has", "kvmeta.save_layer", "kvmeta.wait_for_save", "spec.phase")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b > 0 else 0


def _last(index: TraceIndex, req: str | None, kind: str, where=None) -> dict[str, Any] | None:
    if not req:
        return None
    for i in reversed(index.request_ordinals(req, [kind])):
        e = index.event(i)
        if where is None or where(e):
            return e
    return None


def _last_alloc(index: TraceIndex, req: str | None, inst: str) -> dict[str, Any] | None:
    """The request's latest sched.alloc on ``inst``, with block_ids derived if the file left
    them out (schema v2 grow events; the index parses events lazily, so derive here)."""
    if not req:
        return None
    evs = [e for e in (index.event(i) for i in index.request_ordinals(req, ["sched.alloc"]))
           if e.get("inst") == inst]
    if evs and "block_ids" not in evs[-1]:
        derive_block_lists(evs)
    return evs[-1] if evs else None


def _config(index: TraceIndex, inst: str | None) -> dict[str, Any]:
    if inst:
        e = index.first("sched.config", inst)
        if e:
            return e
    for name in index.inst_names:
        e = index.first("sched.config", name)
        if e:
            return e
    return {}


# ------------------------------------------------------------------------------ block map
@dataclasses.dataclass
class Cell:
    block: int
    pos: int | None  # index in the owner's block list
    tokens: tuple[int, int] | None  # inclusive token range held, None for lookahead/state blocks
    lookahead: bool = False
    state: bool = False
    failed: bool = False  # its KV failed to load (kvload.*)
    failed_step: int | None = None  # the step that failure was handled at


@dataclasses.dataclass
class Pair:
    local: Cell
    remote: Cell
    ok: bool
    why: str = ""
    bytes: str | None = None  # record --kv-checksum: "same" / "differ" from P's block at that position; None: not compared


@dataclasses.dataclass
class GroupMap:
    group: int
    kind: str
    block_size: int
    p_blocks: list[Cell]
    d_blocks: list[Cell]
    pairs: list[Pair]
    load: dict[str, Any] | None = None  # what of D's load reached the group (crossed_groups.per_group), + "range"

    @property
    def mismatches(self) -> int:
        return sum(not p.ok for p in self.pairs)


@dataclasses.dataclass
class BlockMap:
    p_req: str | None
    d_req: str | None
    remote_num_tokens: int | None
    prompt_len: int | None
    groups: list[GroupMap]
    source: str  # which D event gave the pairs: nixl.trim | nixl.read | ''
    event_ids: list[int]
    loads: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # failed loads (model_kvload.notes)

    @property
    def mismatches(self) -> int:
        return sum(g.mismatches for g in self.groups)

    @property
    def bytes_compared(self) -> tuple[int, int]:
        """(blocks whose bytes were compared, of them those that differ): record --kv-checksum."""
        ps = [p for g in self.groups for p in g.pairs if p.bytes is not None]
        return len(ps), sum(p.bytes == "differ" for p in ps)


def _cells(ids: list[int], bs: int, ntok: int | None, state: bool, positions: Any = None) -> list[Cell]:
    """``positions``: each block's token-block index, by block id (a dict) or by place in ``ids`` (a list)."""
    out = []
    ncover = _ceil_div(ntok, bs) if ntok is not None else None
    for j, b in enumerate(ids):
        pos = (positions[j] if isinstance(positions, list) else positions.get(b, j)) if positions is not None else j
        if state:
            out.append(Cell(b, pos, None, state=True))
        elif ncover is not None and pos >= ncover:
            out.append(Cell(b, pos, None, lookahead=True))
        else:
            hi = (pos + 1) * bs - 1
            if ntok is not None:
                hi = min(hi, ntok - 1)
            out.append(Cell(b, pos, (pos * bs, hi)))
    return out


def pair_requests(index: TraceIndex, req: str) -> tuple[str | None, str | None]:
    """(P request, D request) for a selected request id on either side."""
    if req in index.remote_req:
        return index.remote_req[req], req
    for d, p in index.remote_req.items():
        if p == req:
            return req, d
    insts = index.request_insts(req)
    return (req if "P" in insts else None), (req if "D" in insts else None)


def block_map(index: TraceIndex, req: str | None) -> BlockMap | None:
    if not req:
        return None
    p_req, d_req = pair_requests(index, req)
    rf = _last(index, p_req, "nixl.request_finished", lambda e: e.get("side", "P") == "P")
    ra = _last(index, d_req, "nixl.remote_alloc")
    trim = _last(index, d_req, "nixl.trim")
    read = _last(index, d_req, "nixl.read")
    d_alloc = _last_alloc(index, d_req, (ra or trim or {}).get("inst", "D"))
    loads = model_kvload.notes(index, d_req)
    if rf is None and ra is None and trim is None and read is None and not loads:
        return None
    digests = {}  # (side, group) -> {block: digest}: record --kv-checksum
    for side, r in (("P", p_req), ("D", d_req)):
        e = _last(index, r, "kv.digest", lambda x, side=side: x.get("side") == side)
        for g, d in ((e or {}).get("blocks") or {}).items():
            digests[(side, str(g))] = d or {}
    p_cfg = _config(index, rf.get("inst") if rf else "P")
    d_cfg = _config(index, (ra or trim or read or {}).get("inst", "D"))
    rnt = None
    for src in (rf, ra):
        if src and src.get("remote_num_tokens") is not None:
            rnt = src["remote_num_tokens"]
            break
    prompt_len = (rf or {}).get("prompt_len")
    p_ids = (rf or {}).get("block_ids") or (ra or {}).get("remote_block_ids") or []
    if trim:
        d_ids, pairs_l, pairs_r, source = trim["local_in"], trim["local_out"], trim["remote_out"], "nixl.trim"
    elif read:
        d_ids, pairs_l, pairs_r, source = read["local_block_ids"], read["local_block_ids"], read["remote_block_ids"], "nixl.read"
    else:
        d_ids, pairs_l, pairs_r, source = (ra or {}).get("local_block_ids") or [], [], [], ""
    if not d_ids and loads:  # no NIXL events of it: the blocks the scheduler named at the failure
        d_ids = [list(loads[0].get("failed_blocks") or [])]
    loads_of = [dict(x, failed=bool(loads)) for x in _group_loads(index, d_req, d_cfg, ra)]
    tg = d_cfg.get("transfer_group_ids")
    if tg and len(tg) < len(d_cfg.get("block_sizes") or ()):  # the lists P reports, and D's trim, are per transfer group
        p_ids, pairs_l, pairs_r = (_by_group(x, tg) for x in (p_ids, pairs_l, pairs_r))
        if source:
            d_ids = _by_group(d_ids, tg)
    ngroups = max(len(p_ids), len(d_ids), len(pairs_l))
    groups = []
    for g in range(ngroups):
        sizes = d_cfg.get("block_sizes") or p_cfg.get("block_sizes") or [16]
        kinds = d_cfg.get("group_kinds") or p_cfg.get("group_kinds") or []
        bs = sizes[g] if g < len(sizes) else sizes[-1]
        gk = kinds[g] if g < len(kinds) else "FullAttentionSpec"
        state = not is_attention_group(gk)
        pg = list(p_ids[g]) if g < len(p_ids) else []
        dg = list(d_ids[g]) if g < len(d_ids) else []
        # D positions: the full list D holds (sched.alloc) gives each block's place in the
        # request; without it, the blocks to load are the tail of the blocks covering the prompt.
        # (D's list at the load, nixl.remote_alloc's, before a sliding window frees and reuses a block further on;
        # else its latest; a block's first place in it)
        d_full = _held_list(ra, g, dg) or _held_list(d_alloc and {"local_block_ids": d_alloc.get("block_ids")}, g, dg)
        if d_full:
            dpos = {}
            for k, b in enumerate(d_full):
                dpos.setdefault(b, k)
        else:
            ncover = _ceil_div(rnt, bs) if rnt is not None else len(dg)
            base = max(0, ncover - len(dg))
            dpos = {b: base + k for k, b in enumerate(dg)}
        pcells = _cells(pg, bs, rnt, state, _p_positions(rf, g, pg, gk, bs, rnt))
        dcells = _cells(dg, bs, rnt, state, dpos)
        bad = model_kvload.failed_blocks(loads) if g == 0 else {}  # (vLLM reports group 0's ids)
        for c in dcells:
            c.failed, c.failed_step = c.block in bad, bad.get(c.block)
        at = {c.pos: c.block for c in pcells if c.pos is not None}  # P's block at each token position
        dd, pdg = digests.get(("D", str(g)), {}), digests.get(("P", str(g)), {})
        pmap = {c.block: c for c in pcells}
        dmap = {c.block: c for c in dcells}
        pairs = []
        lo = pairs_l[g] if g < len(pairs_l) else []
        ro = pairs_r[g] if g < len(pairs_r) else []
        for lb, rb in zip(lo, ro):
            lc = dmap.get(lb) or Cell(lb, dpos.get(lb), None)
            rc = pmap.get(rb) or Cell(rb, None, None)
            if state:
                pairs.append(Pair(lc, rc, True, "state group: copied whole"))
                continue
            if rc.pos is None:
                pairs.append(Pair(lc, rc, False, f"P never reported block {rb}"))
            elif rc.lookahead:
                pairs.append(Pair(lc, rc, False, f"P block {rb} is a lookahead block (holds no computed tokens)"))
            elif lc.pos is not None and lc.pos != rc.pos:
                want = pg[lc.pos] if lc.pos < len(pg) else "?"
                pairs.append(Pair(lc, rc, False, f"D block {lb} holds tokens of P block {want}, not {rb} (shifted by {rc.pos - lc.pos})"))
            else:
                pairs.append(Pair(lc, rc, True))
        for pr in pairs:  # the bytes D decodes on against P's at the same token position
            pb = at.get(pr.local.pos)
            if str(pr.local.block) in dd and pb is not None and str(pb) in pdg:
                pr.bytes = "same" if dd[str(pr.local.block)] == pdg[str(pb)] else "differ"
        if len(lo) != len(ro):
            pairs.append(Pair(Cell(-1, None, None), Cell(-1, None, None), False,
                              f"{len(lo)} local vs {len(ro)} remote blocks"))
        groups.append(GroupMap(g, gk, bs, pcells, dcells, pairs, loads_of[g] if g < len(loads_of) else None))
    ids = [e["id"] for e in (rf, ra, trim, read) if e]
    ids += [i for n in loads for i in n["events"]]
    return BlockMap(p_req, d_req, rnt, prompt_len, groups, source, ids, loads)


def _p_positions(rf: dict | None, g: int, pg: list[int], kind: str, bs: int, rnt: int | None) -> list[int] | None:
    """Each reported P block's token-block index, by its place in the report: the report is a run of P's own list
    (``allocated_block_ids``, null blocks included), so its first real block's place there says where the run starts;
    without P's list, a sliding-window / chunked group's report is the in-window tail of the blocks covering P's
    tokens; else (None) the place in the report is the index."""
    alloc = (rf or {}).get("allocated_block_ids") or []
    pa = list(alloc[g]) if g < len(alloc) else []
    j = next((i for i, b in enumerate(pg) if b != NULL_BLOCK), None)
    if pa and j is not None and pg[j] in pa and set(pg) - {NULL_BLOCK} <= set(pa):
        start = pa.index(pg[j]) - j
        return [start + i for i in range(len(pg))]
    if is_tail_group(kind) and rnt is not None and pg:
        base = max(0, _ceil_div(rnt, bs) - len(pg))
        return [base + i for i in range(len(pg))]
    return None


def _held_list(e: dict | None, g: int, dg: list[int]) -> list[int]:
    """D's whole list for group ``g`` in ``e`` (``local_block_ids``) where it holds every block of ``dg``."""
    full = (e or {}).get("local_block_ids") or []
    return list(full[g]) if g < len(full) and set(dg) <= set(full[g]) else []


def _by_group(lists: list, tg: list[int]) -> list[list[int]]:
    """Per transfer group lists (in ``transfer_group_ids``' order) placed at their KV cache groups."""
    if len(lists) != len(tg):
        return lists
    out: list[list[int]] = [[] for _ in range(max(tg) + 1)]
    for i, g in enumerate(tg):
        out[g] = list(lists[i])
    return out


def _group_loads(index: TraceIndex, d_req: str | None, d_cfg: dict, ra: dict | None) -> list[dict]:
    """Per KV cache group of D, what of the request's load reached it (kv-never-crossed's per-group facts):
    ``crossed_groups.per_group`` over D's first allocation (its hit, the tokens its connector loads)."""
    if not d_req or not d_cfg:
        return []
    first = next((e for e in (index.event(i) for i in index.request_ordinals(d_req, ["sched.alloc"]))
                  if "num_external_computed_tokens" in e and e.get("inst") == d_cfg.get("inst")), None)
    if first is None or not first.get("num_external_computed_tokens"):
        return []
    local, ext = int(first.get("num_new_computed_tokens") or 0), int(first["num_external_computed_tokens"])
    groups = crossed_groups.groups_of(d_cfg)
    rows = crossed_groups.per_group(groups, d_cfg, ra, local, ext)
    return [{**row, **gi, "range": (local, local + ext)} for gi, row in zip(groups, rows)]


# ------------------------------------------------------------------------------ connector metadata
@dataclasses.dataclass
class MetaLine:
    text: str
    bad: bool
    depth: int
    event_id: int


@dataclasses.dataclass
class MetaView:
    step: int
    inst: str
    lines: list[MetaLine]

    @property
    def gaps(self) -> int:
        return sum(line.bad for line in self.lines)


def metadata(index: TraceIndex, step: int | None) -> list[MetaView]:
    if step is None:
        return []
    views = []
    for inst in index.inst_names:
        ords = index.step_ordinals(step, inst, META_KINDS)
        if not ords:
            continue
        evs = index.events(ords)
        drafter_later = [any(x["ev"] == "spec.phase" and x["phase"] == "drafter" and x["edge"] == "begin"
                             for x in evs[k + 1:]) for k in range(len(evs))]
        lines: list[MetaLine] = []
        bound = False
        phase = ""
        phase_layers: list[str] = []
        saved: list[str] = []
        for k, e in enumerate(evs):
            kind = e["ev"]
            if kind == "kvmeta.bind":
                bound = True
                reqs = ", ".join(e.get("reqs") or [])
                lines.append(MetaLine(f"bind  recv={e['n_recv']} save={e['n_save']} send={e['n_send']}"
                                      + (f"  [{reqs}]" if reqs else ""), False, 0, e["id"]))
            elif kind == "kvmeta.clear":
                bad = bound and drafter_later[k]
                bound = False
                lines.append(MetaLine(f"clear ({('phase ' + e['phase']) if e['phase'] else 'between the model phases'})"
                                      + ("  <- before the drafter forward: drafter layers will not save" if bad else ""),
                                      bad, 0, e["id"]))
            elif kind == "spec.phase":
                if e["edge"] == "begin":
                    phase, phase_layers, saved = e["phase"], list(e.get("layers") or []), []
                    lines.append(MetaLine(f"{phase} forward begin" + (f"  ({len(phase_layers)} layers)" if phase_layers else "")
                                          + (f"  method={e['method']}" if e.get("method") else ""), False, 1, e["id"]))
                else:
                    missing = [x for x in phase_layers if x not in saved]
                    if missing:
                        lines.append(MetaLine(f"no save_kv_layer for {len(missing)} {phase} layer(s): {', '.join(missing)}",
                                              True, 2, e["id"]))
                    lines.append(MetaLine(f"{e['phase']} forward end", False, 1, e["id"]))
                    phase, phase_layers = "", []
            elif kind == "kvmeta.save_layer":
                saved.append(e["layer"])
                lines.append(MetaLine(f"save_kv_layer {e['layer']} ({e['phase']})", False, 2, e["id"]))
            elif kind == "kvmeta.has":
                bad = e["result"] is False and e["phase"] == "drafter"
                lines.append(MetaLine(f"has_connector_metadata() -> {e['result']} ({e['phase'] or 'between'})",
                                      bad, 2, e["id"]))
            elif kind == "kvmeta.wait_for_save":
                lines.append(MetaLine(f"wait_for_save ({e['phase'] or 'between'})", False, 1, e["id"]))
        views.append(MetaView(step, inst, lines))
    return views


# ------------------------------------------------------------------------------ raw events
def raw_ordinals(index: TraceIndex, req: str | None, step: int | None, limit: int = 200) -> list[int]:
    if req:
        ords = index.request_ordinals(req)
        if step is not None:
            at = [i for i in ords if index.steps[i] == step]
            ords = at or ords
        return ords[:limit]
    if step is not None:
        return index.step_ordinals(step)[:limit]
    return list(range(min(limit, len(index))))
