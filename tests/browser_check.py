"""Helpers for the report / export / bundle tests.

- ``write_buggy_trace(path)``: a small schema-valid P/D trace (built with
  ``pdtrace.tracefile.trace.write_trace``) that shows three of the bug classes:
  a misaligned P/D request (P reports a lookahead block, D end-trims and maps its block
  to P's lookahead block), a stale accepted-count read after ``batch.swap``, and
  ``clear_connector_metadata`` before the drafter forward.
- ``write_large_trace(path, n_events)``: a long schema-valid trace for the size bound
  (used when ``bench/gen_trace.py`` is not there).
- ``find_chromium()`` / ``render_with_chromium(html_path, ..., query="?autoclick=0")``: open
  a report in headless Chromium from disk, network off, return the DOM after a virtual-time
  budget and save a screenshot.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pdtrace.tracefile.trace import make_header, write_trace

BS = 16  # block size

_VERSIONS = {"vllm": "0.32.0", "torch": "2.13.0", "nixl": "", "python": "3.11", "pdtrace": "0.1.0"}


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000_000_000
        self.w0 = 1_700_000_000_000_000_000 - self.t

    def tick(self, ns: int = 50_000) -> tuple[int, int]:
        self.t += ns
        return self.t, self.w0 + self.t


def _ev(clk: _Clock, kind: str, pid: int, role: str, inst: str, *, rank: int | None = None,
        dt: int = 50_000, **fields: Any) -> dict[str, Any]:
    t, w = clk.tick(dt)
    e: dict[str, Any] = {"ev": kind, "t": t, "w": w, "pid": pid, "role": role, "inst": inst}
    if rank is not None:
        e["rank"] = rank
    for k, v in fields.items():
        if v is not None:
            e[k] = v
    return e


P_ENG, P_WRK, D_ENG, D_WRK = 100, 101, 200, 201


def buggy_events() -> list[dict[str, Any]]:
    clk = _Clock()
    E: list[dict[str, Any]] = []

    def pe(kind, **kw):
        E.append(_ev(clk, kind, P_ENG, "engine-core", "P", **kw))

    def pw(kind, **kw):
        E.append(_ev(clk, kind, P_WRK, "worker", "P", rank=0, **kw))

    def de(kind, **kw):
        E.append(_ev(clk, kind, D_ENG, "engine-core", "D", **kw))

    def dw(kind, **kw):
        E.append(_ev(clk, kind, D_WRK, "worker", "D", rank=0, **kw))

    for pid, role, inst, rank in ((P_ENG, "engine-core", "P", None), (P_WRK, "worker", "P", 0),
                                  (D_ENG, "engine-core", "D", None), (D_WRK, "worker", "D", 0)):
        E.append(_ev(clk, "proc.start", pid, role, inst, rank=rank, argv=["vllm", "serve"], ppid=1,
                     python="3.11", session="s1"))
    for pid, role, inst, rank in ((P_WRK, "worker", "P", 0), (D_WRK, "worker", "D", 0)):
        E.append(_ev(clk, "hooks.status", pid, role, inst, rank=rank, vllm="0.32.0",
                     applied=["scheduler", "nixl"], skipped={}))
    for kv_role, f in (("kv_producer", pe), ("kv_consumer", de)):
        f("sched.config", block_sizes=[BS], group_kinds=["FullAttentionSpec"], num_lookahead_tokens=2,
          num_spec_tokens=2, spec_method="eagle", kv_role=kv_role, connector="NixlConnector",
          async_scheduling=True, num_blocks=128)

    # ---- prefill instance: r1 (prompt 16 = 1 full block -> lookahead block 11), r2 (20 tokens)
    pe("req.add", req="r1", prompt_len=16, prompt_hash="aa", max_tokens=1, kv={"do_remote_decode": True})
    pe("req.add", req="r2", prompt_len=20, prompt_hash="bb", max_tokens=1, kv={"do_remote_decode": True})
    pe("sched.step", step=1, num_reqs=2, num_tokens=36, tokens={"r1": 16, "r2": 20})
    pe("sched.alloc", step=1, req="r1", ok=True, block_ids=[[10, 11]], new_block_ids=[[10, 11]],
       num_computed_tokens=0, num_new_tokens=16, num_lookahead_tokens=2, sched_lookahead_tokens=2,
       num_external_computed_tokens=0, num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=16)
    pe("sched.alloc", step=1, req="r2", ok=True, block_ids=[[12, 13]], new_block_ids=[[12, 13]],
       num_computed_tokens=0, num_new_tokens=20, num_lookahead_tokens=2, sched_lookahead_tokens=2,
       num_external_computed_tokens=0, num_new_computed_tokens=0, delay_cache_blocks=False, prompt_len=20)
    # P worker step 1: clear_connector_metadata before the drafter (bug 002)
    pw("kvmeta.bind", step=1, connector="NixlConnectorWorker", n_recv=0, n_save=2, n_send=0, reqs=["r1", "r2"])
    pw("spec.phase", step=1, phase="target", edge="begin", layers=["model.layers.0.attn", "model.layers.1.attn"])
    for layer in ("model.layers.0.attn", "model.layers.1.attn"):
        pw("kvmeta.has", step=1, result=True, phase="target")
        pw("kvmeta.save_layer", step=1, layer=layer, phase="target")
    pw("spec.phase", step=1, phase="target", edge="end")
    pw("kvmeta.clear", step=1, phase="")
    pw("spec.phase", step=1, phase="drafter", edge="begin", method="eagle", layers=["draft.layers.0.attn"])
    pw("kvmeta.has", step=1, result=False, phase="drafter")
    pw("spec.phase", step=1, phase="drafter", edge="end", method="eagle")
    pw("kvmeta.wait_for_save", step=1, phase="")
    pe("sched.step", step=2, num_reqs=0, num_tokens=0, tokens={}, finished=["r1", "r2"])
    pe("req.finish", step=2, req="r1", status="FINISHED_LENGTH_CAPPED", num_computed_tokens=16, num_output_tokens=1)
    pe("nixl.request_finished", step=2, req="r1", side="P", allocated_block_ids=[[10, 11]],
       arg_block_ids=[[10, 11]], block_ids=[[10, 11]], remote_num_tokens=16, num_computed_tokens=16,
       prompt_len=16, delay_free=True)
    pe("req.finish", step=2, req="r2", status="FINISHED_LENGTH_CAPPED", num_computed_tokens=20, num_output_tokens=1)
    pe("nixl.request_finished", step=2, req="r2", side="P", allocated_block_ids=[[12, 13]],
       arg_block_ids=[[12, 13]], block_ids=[[12, 13]], remote_num_tokens=20, num_computed_tokens=20,
       prompt_len=20, delay_free=True)

    # ---- decode instance
    de("req.add", req="d-r1", prompt_len=16, prompt_hash="aa", max_tokens=32,
       kv={"do_remote_prefill": True, "remote_request_id": "r1", "remote_engine_id": "P0", "n_remote_blocks": [2]})
    de("req.add", req="d-r2", prompt_len=20, prompt_hash="bb", max_tokens=32,
       kv={"do_remote_prefill": True, "remote_request_id": "r2", "remote_engine_id": "P0", "n_remote_blocks": [2]})
    de("sched.step", step=1, num_reqs=0, num_tokens=0, tokens={})
    de("nixl.remote_alloc", step=1, req="d-r1", local_block_ids=[[5]], remote_block_ids=[[10, 11]],
       remote_num_tokens=16, num_external_tokens=16, remote_req="r1", remote_engine="P0")
    de("nixl.remote_alloc", step=1, req="d-r2", local_block_ids=[[7, 8]], remote_block_ids=[[12, 13]],
       remote_num_tokens=20, num_external_tokens=20, remote_req="r2", remote_engine="P0")
    # buggy end-trim: remote[-1:] -> block 11 (P's lookahead block) instead of 10
    dw("nixl.trim", step=1, req="d-r1", local_in=[[5]], remote_in=[[10, 11]], local_out=[[5]], remote_out=[[11]])
    dw("nixl.read", step=1, req="d-r1", local_block_ids=[[5]], remote_block_ids=[[11]], bytes=65536,
       handle="h1", remote_engine="P0", remote_req="r1")
    dw("nixl.trim", step=1, req="d-r2", local_in=[[7, 8]], remote_in=[[12, 13]], local_out=[[7, 8]],
       remote_out=[[12, 13]])
    dw("nixl.read", step=1, req="d-r2", local_block_ids=[[7, 8]], remote_block_ids=[[12, 13]], bytes=131072,
       handle="h2", remote_engine="P0", remote_req="r2")
    dw("nixl.read_done", step=1, req="d-r1", status="DONE", handle="h1", dur_ns=400_000, dt=400_000)
    dw("nixl.read_done", step=1, req="d-r2", status="DONE", handle="h2", dur_ns=420_000)
    pe("nixl.send_done", step=3, req="r1")
    pe("nixl.send_done", step=3, req="r2")

    # decode steps with async spec decode; stale read after swap (bug 004)
    dw("batch.add", step=2, req="d-r1", row=0)
    dw("batch.add", step=2, req="d-r2", row=1)
    for step in (2, 3, 4):
        de("sched.step", step=step, num_reqs=2, num_tokens=6, tokens={"d-r1": 3, "d-r2": 3},
           spec={"d-r1": 2, "d-r2": 2})
        dw("kvmeta.bind", step=step, connector="NixlConnectorWorker", n_recv=0, n_save=0, n_send=0)
        dw("spec.phase", step=step, phase="target", edge="begin")
        if step == 3:
            dw("batch.swap", step=step, i1=0, i2=1, req1="d-r1", req2="d-r2")
            # read the CPU copy before the D2H copy of step 2 completed: row 0 now holds d-r2
            dw("acc.read", step=step, req="d-r2", row=0, value=2, event="ev2", event_done=False, synced=False)
            dw("acc.read", step=step, req="d-r1", row=1, value=1, event="ev2", event_done=False, synced=False)
            dw("d2h.done", step=step, event="ev2")
        elif step == 4:
            dw("acc.read", step=step, req="d-r2", row=0, value=2, event="ev3", event_done=True, synced=False)
            dw("acc.read", step=step, req="d-r1", row=1, value=1, event="ev3", event_done=True, synced=False)
        dw("spec.phase", step=step, phase="target", edge="end", dt=300_000)
        rows = ["d-r1", "d-r2"] if step == 2 else ["d-r2", "d-r1"]
        dw("d2h.issue", step=step, buf="num_accepted_tokens_cpu", rows=rows, event=f"ev{step}")
        dw("acc.truth", step=step, req="d-r1", value=1 if step == 2 else 2, for_step=step)
        dw("acc.truth", step=step, req="d-r2", value=2 if step == 2 else 1, for_step=step)
        dw("spec.phase", step=step, phase="drafter", edge="begin", method="eagle")
        dw("spec.window", step=step, req="d-r1", start=16 + step, end=19 + step, method="eagle", group=0)
        dw("spec.phase", step=step, phase="drafter", edge="end", method="eagle", dt=200_000)
        dw("kvmeta.clear", step=step, phase="")
    dw("batch.remove", step=5, req="d-r1", row=1)
    dw("batch.remove", step=5, req="d-r2", row=0)
    de("req.finish", step=5, req="d-r1", status="FINISHED_STOPPED", num_computed_tokens=24, num_output_tokens=8)
    de("req.finish", step=5, req="d-r2", status="FINISHED_STOPPED", num_computed_tokens=28, num_output_tokens=8)
    for pid, role, inst, rank in ((P_ENG, "engine-core", "P", None), (P_WRK, "worker", "P", 0),
                                  (D_ENG, "engine-core", "D", None), (D_WRK, "worker", "D", 0)):
        E.append(_ev(clk, "proc.exit", pid, role, inst, rank=rank, events=0, dropped=0, hook_errors={}))
    return E


def write_buggy_trace(path: str | os.PathLike, *, redacted: bool = True) -> str:
    header = make_header(origin="synthetic", cmd=["pytest"], redacted=redacted, versions=dict(_VERSIONS),
                         instances=["P", "D"])
    write_trace(str(path), header, buggy_events())
    return str(path)


def write_large_trace(path: str | os.PathLike, n_events: int, seed: int = 0) -> str:
    """A long schema-valid P/D trace: many requests and steps, one misaligned request in the middle."""
    rng = random.Random(seed)
    base = buggy_events()
    clk = _Clock()
    clk.t = max(e["t"] for e in base) + 1_000_000
    E = list(base)
    step = 10
    n_req = 0
    while len(E) < n_events:
        step += 1
        n_req += 1
        r, d = f"r{n_req + 100}", f"d-r{n_req + 100}"
        plen = rng.randint(17, 900)
        nb = -(-plen // BS)
        pblocks = list(range(1000 + (n_req * 60) % 50_000, 1000 + (n_req * 60) % 50_000 + nb))
        dblocks = list(range(5000 + (n_req * 60) % 50_000, 5000 + (n_req * 60) % 50_000 + nb))
        E.append(_ev(clk, "sched.step", P_ENG, "engine-core", "P", step=step, num_reqs=1, num_tokens=plen,
                     tokens={r: plen}))
        E.append(_ev(clk, "sched.alloc", P_ENG, "engine-core", "P", step=step, req=r, ok=True, block_ids=[pblocks],
                     new_block_ids=[pblocks], num_computed_tokens=0, num_new_tokens=plen, num_lookahead_tokens=0,
                     sched_lookahead_tokens=2, num_external_computed_tokens=0, num_new_computed_tokens=0,
                     delay_cache_blocks=False, prompt_len=plen))
        E.append(_ev(clk, "nixl.request_finished", P_ENG, "engine-core", "P", step=step, req=r, side="P",
                     allocated_block_ids=[pblocks], arg_block_ids=[pblocks], block_ids=[pblocks],
                     remote_num_tokens=plen, num_computed_tokens=plen, prompt_len=plen, delay_free=True))
        E.append(_ev(clk, "sched.step", D_ENG, "engine-core", "D", step=step, num_reqs=1, num_tokens=3,
                     tokens={d: 3}, spec={d: 2}))
        E.append(_ev(clk, "nixl.trim", D_WRK, "worker", "D", rank=0, step=step, req=d, local_in=[dblocks],
                     remote_in=[pblocks], local_out=[dblocks], remote_out=[pblocks]))
        E.append(_ev(clk, "nixl.read", D_WRK, "worker", "D", rank=0, step=step, req=d, local_block_ids=[dblocks],
                     remote_block_ids=[pblocks], bytes=nb * 65536, handle=f"h{n_req}", remote_req=r))
        E.append(_ev(clk, "nixl.read_done", D_WRK, "worker", "D", rank=0, step=step, req=d, status="DONE",
                     handle=f"h{n_req}", dur_ns=300_000, dt=300_000))
        E.append(_ev(clk, "d2h.issue", D_WRK, "worker", "D", rank=0, step=step, buf="num_accepted_tokens_cpu",
                     rows=[d], event=f"e{step}"))
        E.append(_ev(clk, "d2h.done", D_WRK, "worker", "D", rank=0, step=step, event=f"e{step}"))
        E.append(_ev(clk, "acc.read", D_WRK, "worker", "D", rank=0, step=step, req=d, row=0, value=2,
                     event=f"e{step}", event_done=True, synced=False))
        for ph in ("target", "drafter"):
            E.append(_ev(clk, "spec.phase", D_WRK, "worker", "D", rank=0, step=step, phase=ph, edge="begin"))
            E.append(_ev(clk, "kvmeta.save_layer", D_WRK, "worker", "D", rank=0, step=step,
                         layer=f"{ph}.layers.0.attn", phase=ph))
            E.append(_ev(clk, "spec.phase", D_WRK, "worker", "D", rank=0, step=step, phase=ph, edge="end"))
        E.append(_ev(clk, "kvmeta.clear", D_WRK, "worker", "D", rank=0, step=step, phase=""))
    header = make_header(origin="synthetic", cmd=["pytest"], redacted=True, versions=dict(_VERSIONS),
                         instances=["P", "D"])
    write_trace(str(path), header, E)
    return str(path)


# --------------------------------------------------------------------------------------
# headless Chromium
# --------------------------------------------------------------------------------------

def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-dev-shm-usage", "--hide-scrollbars",
    # no network at all: every host resolves nowhere (the page is a file:// URL)
    "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
]


def _run_chromium(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def render_with_chromium(html_path: str | os.PathLike, *, screenshot: str | os.PathLike | None = None,
                         budget_ms: int = 10_000, window: str = "1400,4000",
                         timeout: float = 120.0, query: str = "") -> str:
    """Return the DOM of ``html_path`` after ``budget_ms`` of virtual time; optionally save a
    screenshot. ``query`` is appended to the file URL (the report's test hooks:
    ``?autoclick=K`` selects finding K, ``?ev=N`` opens event N)."""
    exe = find_chromium()
    if exe is None:
        raise RuntimeError("chromium not found")
    url = Path(html_path).resolve().as_uri() + query
    with tempfile.TemporaryDirectory(prefix="pdtrace-chromium-") as prof:
        base = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={prof}", f"--virtual-time-budget={budget_ms}",
                f"--window-size={window}"]
        dom = _run_chromium([*base, "--dump-dom", url], timeout)
        if dom.returncode != 0:
            raise RuntimeError(f"chromium --dump-dom failed ({dom.returncode}): {dom.stderr[-2000:]}")
        if screenshot is not None:
            shot = _run_chromium([*base, f"--screenshot={Path(screenshot).resolve()}", url], timeout)
            if shot.returncode != 0 or not Path(screenshot).exists():
                raise RuntimeError(f"chromium --screenshot failed ({shot.returncode}): {shot.stderr[-2000:]}")
    return dom.stdout
