"""connector-metadata-cleared-before-drafter (vLLM thread 002).

The model runner cleared the KV connector metadata after the target forward but before
the drafter forward, so ``has_connector_metadata()`` was False during the drafter's
attention layers and their ``save_kv_layer`` never ran: the drafter's KV was never sent.

Per worker process, a step runs from one ``kvmeta.bind`` to the next. The finding fires
on an instance that saves KV (P or PD) when the drafter phase ran without metadata:
a ``kvmeta.clear`` after the bind and before the drafter began, or ``kvmeta.has`` False
during the drafter phase.
"""

from __future__ import annotations

from typing import Any

from .base import METADATA_CLEARED_BEFORE_DRAFTER, SEVERITY_ERROR, SEVERITY_WARNING, Finding
from .index import feed_all, kind_code

Event = dict[str, Any]

_KINDS = ("kvmeta.bind", "kvmeta.clear", "kvmeta.has", "kvmeta.save_layer", "spec.phase")
_SAVING_ROLES = ("kv_producer", "kv_both")


class _Step:
    __slots__ = ("bind", "clear_before_drafter", "drafter_begin", "drafter_end",
                 "in_drafter", "has_false", "target_saved", "drafter_saved", "drafter_layers",
                 "step", "cleared")

    def __init__(self, bind: Event | None):
        self.bind = bind
        self.clear_before_drafter: Event | None = None
        self.cleared: Event | None = None
        self.drafter_begin: Event | None = None
        self.drafter_end: Event | None = None
        self.in_drafter = False
        self.has_false: list[Event] = []
        self.target_saved: list[str] = []
        self.drafter_saved: list[str] = []
        self.drafter_layers: list[str] = []
        self.step = bind.get("step") if bind is not None else None


def _saves_kv(idx, inst: str) -> bool:
    if inst in ("P", "PD"):
        return True
    cfg = idx.config(inst) if inst not in ("D", "-") else None
    return bool(cfg and cfg.get("kv_role") in _SAVING_ROLES and cfg.get("inst") == inst)


def _suspect(st: _Step) -> bool:
    """The drafter phase of this step ran without connector metadata."""
    return st.drafter_begin is not None and (st.clear_before_drafter is not None or bool(st.has_false))


class Stream:
    """The detector over events fed in trace order (``feed`` one ``Index`` of consecutive
    events at a time, then ``finish``). It keeps the open step of each worker process (and
    TP rank) and the steps whose drafter phase ran without metadata; whether the instance
    saves KV is decided at ``finish``, from every scheduler config read."""

    KINDS = _KINDS  # (what it reads, besides the configs)

    def __init__(self, header: dict | None = None):
        self.by_proc: dict[tuple, list[_Step]] = {}  # (pid, rank) -> suspect steps, in order
        self.cur: dict[tuple, _Step] = {}
        self.configs: Any = None

    def _close(self, key: tuple) -> None:
        st = self.cur.get(key)
        if st is not None and _suspect(st):
            self.by_proc[key].append(st)

    def feed(self, idx: Any) -> None:
        self.configs = idx.configs
        if not any(idx.kind(k) for k in _KINDS):
            return
        BIND, CLEAR, HAS, SAVE, PHASE = (kind_code(k) for k in _KINDS)
        by_proc, cur = self.by_proc, self.cur
        for e, k in zip(*idx.ordered_codes(_KINDS)):
            key = (e["pid"], e.get("rank"))
            if k == BIND:
                if key in cur:
                    self._close(key)
                else:
                    by_proc.setdefault(key, [])
                cur[key] = _Step(e)
                continue
            st = cur.get(key)
            if st is None:
                st = cur[key] = _Step(None)
                by_proc.setdefault(key, [])
            if st.step is None and e.get("step") is not None:
                st.step = e["step"]
            if k == CLEAR:
                if st.drafter_begin is None and st.cleared is None:
                    st.cleared = e
            elif k == PHASE:
                if e["phase"] == "drafter":
                    if e["edge"] == "begin":
                        st.drafter_begin = e
                        st.in_drafter = True
                        st.drafter_layers = list(e.get("layers") or [])
                        if st.cleared is not None:
                            st.clear_before_drafter = st.cleared
                    else:
                        st.drafter_end = e
                        st.in_drafter = False
            elif k == HAS:
                if (st.in_drafter or e.get("phase") == "drafter") and e["result"] is False:
                    st.has_false.append(e)
            elif k == SAVE:
                (st.drafter_saved if e["phase"] == "drafter" else st.target_saved).append(e["layer"])

    def finish(self) -> list[Finding]:
        for key in list(self.cur):
            self._close(key)
        self.cur = {}
        return _findings(self.by_proc, self.configs)


def detect(events: list[Event], header: dict | None = None) -> list[Finding]:
    return feed_all(Stream(header), events)


def _findings(by_proc: dict[tuple, list[_Step]], idx: Any) -> list[Finding]:
    findings: list[Finding] = []
    seen: dict[tuple, Finding] = {}  # (inst, step) -> finding: TP ranks of one step fold into one
    for (pid, rank), steps in by_proc.items():
        for st in steps:
            if st.drafter_begin is None:
                continue
            if st.clear_before_drafter is None and not st.has_false:
                continue
            inst = st.drafter_begin.get("inst", "")
            if not _saves_kv(idx, inst):
                continue
            if st.step is not None and (inst, st.step) in seen:
                seen[(inst, st.step)].data["ranks"].append(rank)
                continue
            n_save = (st.bind or {}).get("n_save")
            missing = [l for l in st.drafter_layers if l not in set(st.drafter_saved)]
            damaged = bool(st.target_saved) and not st.drafter_saved
            severity = SEVERITY_ERROR if damaged and n_save != 0 else SEVERITY_WARNING
            clear = st.clear_before_drafter
            ids = [e["id"] for e in (st.bind, clear, st.drafter_begin, st.drafter_end) if e is not None and "id" in e]
            ids += [e["id"] for e in st.has_false[:16] if "id" in e]
            reqs = list((st.bind or {}).get("reqs") or [])
            where = f"pid {pid}" + (f" rank {rank}" if rank is not None else "")
            if clear is not None:
                why = (f"kvmeta.clear (event {clear.get('id')}, {_phase(clear.get('phase'))}) ran before the "
                       f"drafter phase began (event {st.drafter_begin.get('id')})")
            else:
                why = "the connector metadata was gone when the drafter phase began"
            layers_txt = (f"drafter layer(s) {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
                          if missing else f"{len(st.has_false)} drafter layer call(s)")
            title = (f"step {st.step}: connector metadata cleared before the drafter ran on {inst} "
                     f"({len(missing) or len(st.has_false)} drafter layer(s) did not save KV)")
            expl = (
                f"On {inst} ({where}, step {st.step}) {why}, so has_connector_metadata() answered False "
                f"{len(st.has_false)} time(s) during the drafter forward and save_kv_layer never ran for "
                f"{layers_txt}. The target model saved {len(st.target_saved)} layer(s) and the drafter "
                f"{len(st.drafter_saved)}; {_named(n_save, reqs)}. "
                + ("Nothing was to be saved at this step, so no KV was lost here (latent); at a step that saves, "
                   "the drafter's KV would not reach D. " if n_save == 0 else
                   f"The drafter's KV for {'these requests' if reqs else 'the requests of this step'} was never "
                   f"transferred to D. ")
                + "Clear the metadata only after the drafter proposes."
            )
            f = Finding(
                kind=METADATA_CLEARED_BEFORE_DRAFTER, severity=severity, req=reqs[0] if len(reqs) == 1 else None,
                step=st.step, inst=inst, event_ids=sorted(set(ids)), title=title, explanation=expl,
                data={
                    "pid": pid, "rank": rank, "clear_event": clear.get("id") if clear else None,
                    "clear_phase": clear.get("phase") if clear else None,
                    "drafter_begin_event": st.drafter_begin.get("id"),
                    "has_false_events": [e.get("id") for e in st.has_false],
                    "target_layers_saved": st.target_saved, "drafter_layers_saved": st.drafter_saved,
                    "drafter_layers_not_saved": missing, "n_save": n_save, "reqs": reqs,
                    "ranks": [rank],
                })
            findings.append(f)
            if st.step is not None:
                seen[(inst, st.step)] = f
    return findings


def _phase(p: Any) -> str:
    """kvmeta.clear's phase as check and the viewer both say it ('' is between the phases)."""
    return f"phase {p}" if p else "between the model phases"


def _named(n_save: Any, reqs: list) -> str:
    """What the bound metadata named: its requests (``reqs``) and how many of them it asked to
    save (``n_save``), said so that 0 to save beside a named request does not read as a
    contradiction (a request the metadata names only to receive or send)."""
    ids = (" " + ", ".join(map(str, reqs[:8])) + (f" (+{len(reqs) - 8})" if len(reqs) > 8 else "")) if reqs else ""
    if n_save is None:
        return f"the metadata named{ids}" if reqs else "the metadata's requests are not in the trace"
    if reqs:
        return f"the metadata named {len(reqs)} request(s){ids}, {n_save} of them to save"
    return f"the metadata named {n_save} request(s) to save"
