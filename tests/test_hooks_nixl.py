"""NIXL connector hooks on vLLM 0.32.0.

Scheduler-side hooks (request_finished, update_state_after_alloc) and the trim hook run on
the real code through the P/D harness. The read/completion hooks wrap worker methods that
need a registered NIXL agent and GPU KV caches; those tests check the hook against the
real function's signature (the registry's check) and drive it through a faithful minimal
caller with the same signature, as stated in each docstring.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ev(r, kind, **m):
    out = [e for e in r.events if e["ev"] == kind and all(e.get(k) == v for k, v in m.items())]
    assert out, f"no {kind} {m}"
    return out[0]


def test_nixl_hooks_resolve_on_installed_vllm(pd_harness):
    from pdtrace import hooks

    pd_harness.install_scheduler_hooks()
    for name, spec in hooks.REGISTRY.items():
        if spec.subsystem != "nixl":
            continue
        status, reason = hooks.check(spec)
        if spec.optional:
            continue
        assert status == "ok", (name, reason)


@pytest.mark.parametrize("prompt_len,bs,k", [(16, 16, 3), (32, 16, 3), (20, 16, 3), (16, 4, 5)])
def test_p_request_finished_clean(pd_harness, pd_pair, prompt_len, bs, k):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=k, block_size=bs)
    r = pd_harness.run_pd_request(cfg, prompt_len, pair=pd_pair(cfg))
    rf = _ev(r, "nixl.request_finished", req=r.p_req)
    assert rf["side"] == "P" and rf["inst"] == "P"
    assert rf["remote_num_tokens"] == prompt_len == rf["num_computed_tokens"] == rf["prompt_len"]
    assert rf["delay_free"] is True
    assert rf["allocated_from"] == "kv_cache_manager"
    alloc = _ev(r, "sched.alloc", req=r.p_req)["block_ids"]
    assert rf["allocated_block_ids"] == alloc  # lookahead blocks included
    # the fixed rule: only blocks covering remote_num_tokens are reported
    n = cdiv(prompt_len, bs)
    assert rf["arg_block_ids"] == [alloc[0][:n]] == rf["block_ids"]
    assert r.p_reported == rf["block_ids"]


def test_p_request_finished_old_rule_reports_lookahead(pd_harness, pd_pair):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 16, pair=pd_pair(cfg), faults=("old_p_block_rule",))
    fi = _ev(r, "fault.inject")
    assert fi["rule"] == "p-sends-full-allocation" and fi["sim"] is True
    rf = _ev(r, "nixl.request_finished", req=r.p_req)
    assert len(rf["allocated_block_ids"][0]) == 2
    assert rf["block_ids"] == rf["allocated_block_ids"]  # lookahead block reported
    assert rf["remote_num_tokens"] == 16  # ...although it covers only 16 tokens = 1 block


@pytest.mark.parametrize("fault", [False, True])
def test_d_remote_alloc_and_trim(pd_harness, pd_pair, fault):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16)
    r = pd_harness.run_pd_request(cfg, 32, pair=pd_pair(cfg), faults=("old_p_block_rule",) if fault else ())
    ra = _ev(r, "nixl.remote_alloc", req=r.d_req)
    assert ra["inst"] == "D"
    assert ra["remote_block_ids"] == r.p_reported
    assert ra["remote_num_tokens"] == 32 and ra["num_external_tokens"] == 32
    assert ra["remote_req"] == r.p_req
    d_alloc = _ev(r, "sched.alloc", req=r.d_req)
    assert ra["local_block_ids"] == d_alloc["block_ids"] and len(ra["local_block_ids"][0]) == 2

    tr = _ev(r, "nixl.trim", req=r.d_req)
    assert tr["local_in"] == r.d_local and tr["remote_in"] == r.p_reported
    assert tr["local_out"] == r.d_local and tr["mamba"] is False
    p_alloc = _ev(r, "sched.alloc", req=r.p_req)["block_ids"][0]
    if not fault:
        # D block i <- P block i
        assert tr["remote_out"] == [p_alloc[:2]]
    else:
        # end-trim of a 3-block report onto 2 local blocks: shifted by one, P's first block dropped
        assert r.p_reported == [p_alloc] and len(p_alloc) == 3
        assert tr["remote_out"] == [p_alloc[1:3]]
        assert p_alloc[0] not in tr["remote_out"][0]
    rd = _ev(r, "nixl.read", req=r.d_req)
    assert rd["sim"] is True
    assert rd["local_block_ids"] == tr["local_out"] and rd["remote_block_ids"] == tr["remote_out"]


def test_trim_hybrid_leaves_state_group(pd_harness, pd_pair):
    cfg = pd_harness.PDConfig(spec_method="eagle", num_spec_tokens=3, block_size=16, hybrid=True)
    r = pd_harness.run_pd_request(cfg, 16, pair=pd_pair(cfg))
    rf = _ev(r, "nixl.request_finished", req=r.p_req)
    assert len(rf["block_ids"]) == 2
    assert rf["block_ids"][0] == rf["allocated_block_ids"][0][:1]  # attention group clipped
    tr = _ev(r, "nixl.trim", req=r.d_req)
    assert tr["mamba"] is True
    assert len(tr["local_out"]) == 2
    assert len(tr["local_out"][1]) == len(tr["remote_out"][1])  # state slots paired by position
    assert tr["remote_out"][0] == rf["block_ids"][0]


def test_read_and_completion_hooks_minimal_caller(pd_harness):
    """The worker-side read/completion hooks (NixlPullConnectorWorker._read_blocks and
    NixlBaseConnectorWorker.get_transfer_results) need a NIXL agent and GPU KV caches to run
    for real. Here: (1) the registry's check confirms the hooks match the REAL 0.32.0
    signatures, (2) the same wrap factories are applied to minimal callers with those exact
    signatures that behave like the real ones at the points the hooks read (call the real
    _apply_prefix_caching, append a handle to _recving_transfers, return a real
    KVConnectorTransferResults)."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    from pdtrace import hooks
    from pdtrace.record import recorder

    pd_harness.install_scheduler_hooks()
    read_spec, res_spec = hooks.REGISTRY["nixl.read"], hooks.REGISTRY["nixl.transfer_results"]
    assert hooks.check(read_spec) == ("ok", "") and hooks.check(res_spec) == ("ok", "")
    real_read = read_spec.original or NixlPullConnectorWorker._read_blocks

    def _read_blocks(self, read_spec, dst_engine_id, request_id, remote_request_id, local_xfer_side_handle,
                     local_dram_handle, remote_xfer_side_handle, expected_consumers, awaiting_kvs):
        local, remote = self._apply_prefix_caching(read_spec.local_block_ids, read_spec.remote_block_ids, 1, 1)
        self._recving_transfers.setdefault(request_id, []).append(4242)
        return True

    assert list(inspect.signature(_read_blocks).parameters) == list(inspect.signature(real_read).parameters)
    read = read_spec.wrap(_read_blocks)
    results = res_spec.wrap(lambda self: KVConnectorTransferResults(
        finished_sending={"p-req"}, finished_recving={"d-req"}, failed_recving={"d-bad"}))

    w = object.__new__(NixlPullConnectorWorker)
    w._has_mamba = False
    w._recving_transfers = {}
    w.block_len_per_layer = [1024, 1024]
    w._pdtrace_inst = "D"
    rec = pd_harness.new_recorder()
    prev = recorder.set_current(rec)
    try:
        ok = read(w, ReadSpec(remote_rank=0, local_block_ids=[[7, 8]], remote_block_ids=[[1, 2, 3]]),
                  "eng-P", "d-req", "p-req", 0, None, 0, 1, True)
        results(w)
    finally:
        recorder.set_current(prev)
    assert ok is True
    rec.flush()
    kinds = [e["ev"] for e in rec.events]
    assert kinds == ["nixl.trim", "nixl.read", "nixl.read_done", "nixl.read_done", "nixl.send_done"]
    trim, rd, done, err, sent = rec.events
    assert trim["req"] == "d-req" and trim["remote_out"] == [[2, 3]]
    assert rd["local_block_ids"] == [[7, 8]] and rd["remote_block_ids"] == [[2, 3]]
    assert rd["handle"] == "4242" and rd["bytes"] == 2 * 2048
    assert rd["remote_engine"] == "eng-P" and rd["remote_req"] == "p-req" and "sim" not in rd
    assert done["req"] == "d-req" and done["status"] == "DONE" and done["dur_ns"] >= 0
    assert err["req"] == "d-bad" and err["status"] == "ERR"
    assert sent["req"] == "p-req"
    assert isinstance(NixlBaseConnectorWorker.get_transfer_results.__pdtrace_hook__, str)


class _Stop(Exception):
    pass


def test_push_mode_trim_carries_its_request(pd_harness):
    """Push mode (P writes into D): the REAL NixlPushConnectorWorker._xfer_blocks, installed
    hooks and all, on a minimal worker object that holds exactly the attributes the method reads
    up to its trim (transfer topology, world size, physical-per-logical ratios); the next step
    (_compute_desc_ids, which needs registered NIXL descriptors) is stopped. The real
    _apply_prefix_caching inside it runs; its nixl.trim carries P's request, D's (remote_req)
    and mode "push"."""
    import types

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

    from pdtrace import hooks
    from pdtrace.record import recorder

    status = pd_harness.install_scheduler_hooks()
    assert status["nixl.push_xfer"] in ("applied", "ok") and hooks.check(hooks.REGISTRY["nixl.push_xfer"]) == ("ok", "")
    w = object.__new__(NixlPushConnectorWorker)
    info = types.SimpleNamespace(remote_block_size=16, remote_physical_blocks_per_logical=1)
    w.transfer_topo = types.SimpleNamespace(get_engine_info=lambda eng: info, block_size_ratio=lambda bs: 1)
    w.world_size, w._physical_blocks_per_logical_kv_block, w._has_mamba = 1, 1, False
    w.dst_num_blocks = w.dst_region_num_blocks = w.dst_region_group_ids = {"eng-D": None}
    w.dst_uses_region_group_mapping = {"eng-D": False}
    w._pdtrace_inst = "P"

    def stop(*a, **k):
        raise _Stop

    w._compute_desc_ids = stop
    rec = pd_harness.new_recorder()
    prev = recorder.set_current(rec)
    try:
        with pytest.raises(_Stop):
            w._xfer_blocks(ReadSpec(remote_rank=0, local_block_ids=[[1, 2, 3]], remote_block_ids=[[7, 8]]),
                           "eng-D", "p-req", "d-req", 0, 0)
    finally:
        recorder.set_current(prev)
    rec.flush()
    (trim,) = [e for e in rec.events if e["ev"] == "nixl.trim"]
    assert trim["req"] == "p-req" and trim["remote_req"] == "d-req" and trim["mode"] == "push"
    assert trim["inst"] == "P" and trim["local_in"] == [[7, 8]] and trim["remote_out"] == [[2, 3]]
    assert "by_region" not in trim
    assert w._pdtrace_push is None and w._pdtrace_cur_req is None  # cleared though the call raised


def test_region_trim_is_recorded_with_its_request(pd_harness):
    """The region-layout path: pull mode's _read_blocks_for_req calls the REAL
    _apply_prefix_caching_by_region before _read_blocks. A minimal caller with the real
    _read_blocks_for_req signature (checked) calls the real by-region trim as vLLM does."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    from pdtrace import hooks
    from pdtrace.record import recorder

    pd_harness.install_scheduler_hooks()
    spec = hooks.REGISTRY["nixl.read_for_req"]
    assert hooks.check(spec) == ("ok", "") and hooks.check(hooks.REGISTRY["nixl.trim_by_region"]) == ("ok", "")

    def _read_blocks_for_req(self, req_id, meta):
        return self._apply_prefix_caching_by_region([[7, 8]], [[1, 2, 3]])

    real = spec.original or NixlPullConnectorWorker._read_blocks_for_req
    assert list(inspect.signature(_read_blocks_for_req).parameters) == list(inspect.signature(real).parameters)
    w = object.__new__(NixlPullConnectorWorker)
    w._has_mamba, w._pdtrace_inst = False, "D"
    rec = pd_harness.new_recorder()
    prev = recorder.set_current(rec)
    try:
        out = spec.wrap(_read_blocks_for_req)(w, "d-req", None)
    finally:
        recorder.set_current(prev)
    rec.flush()
    assert out == ([[7, 8]], [[2, 3]])
    (trim,) = [e for e in rec.events if e["ev"] == "nixl.trim"]
    assert trim["req"] == "d-req" and trim["by_region"] is True and trim["remote_out"] == [[2, 3]]
    assert "mode" not in trim


def test_push_mode_completed_write_is_a_send_done(pd_harness):
    """Push mode: the REAL NixlPushConnectorWorker.get_transfer_results (and the real base method it calls, with
    its lease reaper), on a minimal worker object holding exactly the attributes they read; the NIXL agent is a
    stand-in whose transfer state is DONE. The override adds a request whose WRITE into D completed to
    finished_sending after the hooked base method returned: its own hook records that send_done (mode "push"),
    once, beside the lease's end the base hook recorded."""
    import collections
    import queue
    import threading
    import time
    import types

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    from pdtrace import hooks
    from pdtrace.record import recorder

    status = pd_harness.install_scheduler_hooks()
    assert status["nixl.push_send_done"] in ("applied", "ok")
    assert hooks.check(hooks.REGISTRY["nixl.push_send_done"]) == ("ok", "")
    w = object.__new__(NixlPushConnectorWorker)
    w.transfer_topo, w.tp_rank, w.use_host_buffer, w._pdtrace_inst = types.SimpleNamespace(), 0, False, "P"
    w._pending_completion_notifs, w._failed_recv_reqs, w._evict_finished_inbox = queue.Queue(), queue.Queue(), queue.Queue()
    w._recving_transfers, w._recving_metadata, w._recv_failures, w._replicated_pcp_done_sending = {}, {}, set(), set()
    w._reqs_to_send = {"p-req": time.perf_counter() + 100, "p-old": time.perf_counter() - 1}  # p-old's lease ran out
    w._reqs_to_process = {"p-req", "p-old"}
    w._sending_transfers, w._send_failures = {"p-req": ["h1"]}, set()  # p-req: one WRITE handle, DONE
    w._sending_transfers_lock, w._push_writer_wake = threading.Lock(), threading.Event()
    w.consumer_notification_counts_by_req = collections.defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.nixl_wrapper = types.SimpleNamespace(check_xfer_state=lambda h: "DONE", get_xfer_telemetry=lambda h: None,
                                           release_xfer_handle=lambda h: None)
    w.xfer_stats = types.SimpleNamespace(record_transfer=lambda r: None, record_kv_expired_req=lambda: None)
    rec = pd_harness.new_recorder()
    prev = recorder.set_current(rec)
    try:
        res = w.get_transfer_results()
    finally:
        recorder.set_current(prev)
    assert res.finished_sending == {"p-req", "p-old"}  # vLLM's own answer
    rec.flush()
    sent = sorted((e["req"], e.get("mode")) for e in rec.events if e["ev"] == "nixl.send_done")
    assert sent == [("p-old", None), ("p-req", "push")]
    assert [e["req"] for e in rec.events if e["ev"] == "nixl.lease_expired"] == ["p-old"]
    assert w._pdtrace_sent is None
