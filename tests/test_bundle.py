"""`pdtrace bundle`: the bug-report archive (trace, check.md, report.html, doctor, versions, README)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

from pdtrace.commands import bundle as bundle_cmd  # noqa: E402
from pdtrace.errors import PdtraceError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILES = {"buggy.jsonl", "check.md", "report.html", "doctor.txt", "versions.json", "README.txt"}


def _members(archive: Path) -> dict[str, bytes]:
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            return {n: zf.read(n) for n in zf.namelist()}
    with tarfile.open(archive, "r:gz") as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


@pytest.mark.parametrize("name", ["bug.tar.gz", "bug.zip"])
def test_bundle_contents(tmp_path, name):
    trace = Path(bc.write_buggy_trace(tmp_path / "buggy.jsonl"))
    out = tmp_path / name
    assert bundle_cmd.run(trace, out, allow_unredacted=False, lenient=False) == 0
    m = _members(out)
    # + the regression tests of the causes `pdtrace repro --cause N` rebuilds: 1 (the accepted-count read after a row
    # move), 2 (lookahead) and 3 (the connector metadata cleared before the drafter)
    assert {n.split("/", 1)[1] for n in m} == FILES | {"test_cause_1.py", "test_cause_2.py", "test_cause_3.py"}
    assert "def test_the_drafters_layers_save_kv_while_the_steps_metadata_is_bound" in m["pdtrace-bug/test_cause_3.py"].decode()
    assert "def test_each_decode_reads_its_own_accepted_count_after_the_rows_moved" in m["pdtrace-bug/test_cause_1.py"].decode()
    assert all(n.startswith("pdtrace-bug/") for n in m)
    get = lambda n: m[f"pdtrace-bug/{n}"]  # noqa: E731
    repro = get("test_cause_2.py").decode()
    assert "def test_p_hands_d_only_the_blocks_holding_its_computed_tokens" in repro
    assert "import pdtrace" not in repro and "from pdtrace" not in repro
    assert "test_cause_N.py" in get("README.txt").decode()
    assert get("buggy.jsonl") == trace.read_bytes()
    check_md = get("check.md").decode()
    assert "lookahead-block-misalignment" in check_md  # the markdown of `pdtrace check`
    report = get("report.html").decode()
    assert 'id="fig-timeline"' in report and "pd-plotly" in report
    versions = json.loads(get("versions.json"))
    assert versions["trace"]["vllm"] == "0.32.0" and "python" in versions["here"]
    assert get("doctor.txt").strip()  # doctor's output, or why it could not run
    readme = get("README.txt").decode()
    for f in FILES:
        assert f in readme, f"README does not explain {f}"


def test_bundle_refuses_unredacted_trace(tmp_path):
    trace = Path(bc.write_buggy_trace(tmp_path / "secret.jsonl", redacted=False))
    out = tmp_path / "bug.tar.gz"
    with pytest.raises(PdtraceError) as ei:
        bundle_cmd.run(trace, out, allow_unredacted=False, lenient=False)
    assert ei.value.exit_code == 2 and "--allow-unredacted" in str(ei.value)
    assert not out.exists()
    # through the CLI: exit 2 and a clear message on stderr
    r = subprocess.run([sys.executable, "-m", "pdtrace", "bundle", str(trace), "-o", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "refusing to bundle" in r.stderr and "redacted: false" in r.stderr
    assert not out.exists()
    # allowed explicitly
    assert bundle_cmd.run(trace, out, allow_unredacted=True, lenient=False) == 0
    assert "pdtrace-bug/secret.jsonl" in _members(out)


def test_bundle_refuses_token_ids_even_if_header_says_redacted(tmp_path):
    events = bc.buggy_events()
    for e in events:
        if e["ev"] == "req.add":
            e["prompt_ids"] = list(range(e["prompt_len"]))
    from pdtrace.tracefile.trace import make_header, write_trace

    trace = tmp_path / "ids.jsonl"
    write_trace(str(trace), make_header(origin="synthetic", redacted=True), events)
    with pytest.raises(PdtraceError, match="prompt token ids"):
        bundle_cmd.run(trace, tmp_path / "b.zip", allow_unredacted=False, lenient=False)


def test_bundle_rejects_unknown_archive_name(tmp_path):
    trace = Path(bc.write_buggy_trace(tmp_path / "buggy.jsonl"))
    with pytest.raises(PdtraceError, match=r"\.tar\.gz"):
        bundle_cmd.run(trace, tmp_path / "bug.rar", allow_unredacted=False, lenient=False)


def test_bundle_copes_when_doctor_finds_no_vllm(tmp_path, monkeypatch):
    """Doctor run on a machine without vLLM (simulated: find_spec('vllm') -> None) still gives a bundle."""
    import importlib.util

    from pdtrace.commands import doctor

    real = importlib.util.find_spec
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    trace = Path(bc.write_buggy_trace(tmp_path / "buggy.jsonl"))
    out = tmp_path / "bug.tar.gz"
    assert bundle_cmd.run(trace, out, allow_unredacted=False, lenient=False) == 0
    text = _members(out)["pdtrace-bug/doctor.txt"].decode()
    assert "not installed" in text and "exit code 2" in text


def test_bundle_copes_when_doctor_crashes(tmp_path, monkeypatch):
    from pdtrace.commands import doctor

    def boom(json_out=False):
        raise RuntimeError("doctor exploded")

    monkeypatch.setattr(doctor, "run", boom)
    trace = Path(bc.write_buggy_trace(tmp_path / "buggy.jsonl"))
    out = tmp_path / "bug.zip"
    assert bundle_cmd.run(trace, out, allow_unredacted=False, lenient=False) == 0
    assert "RuntimeError: doctor exploded" in _members(out)["pdtrace-bug/doctor.txt"].decode()
