"""Argv masking by key name anywhere (issue 20): what is masked and what is kept.

The lists below are the contract: every XYZZY* value must vanish, every KEPT argument
must come back unchanged (masking config that is not secret would cost a bug report the
information it needs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdtrace.record.redact import MASK, is_secret_key, mask_argv
from pdtrace.tracefile.trace import load

MASKED = [  # (argv, the masked form)
    (["--api-key", "XYZZY1"], ["--api-key", MASK]),
    (["--api-key=XYZZY2"], [f"--api-key={MASK}"]),
    (["--secret-key", "XYZZY3"], ["--secret-key", MASK]),
    (["--hf-token", "XYZZY4"], ["--hf-token", MASK]),
    (["--password=XYZZY5"], [f"--password={MASK}"]),
    (["HF_TOKEN=XYZZY6"], [f"HF_TOKEN={MASK}"]),
    (["AWS_SECRET_ACCESS_KEY=XYZZY7"], [f"AWS_SECRET_ACCESS_KEY={MASK}"]),
    (["--header", "Authorization: Bearer XYZZY8"], ["--header", f"Authorization: {MASK}"]),
    (["-H", "X-Api-Key: XYZZY9"], ["-H", f"X-Api-Key: {MASK}"]),
    (["Bearer XYZZY10"], [f"Bearer {MASK}"]),
    (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_connector_extra_config":{"api_key":"XYZZY11"}}'],
     ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"api_key": "***"}}']),
    (["-d", '{"apiKey": "XYZZY12", "n": 1}'], ["-d", '{"apiKey": "***", "n": 1}']),
    (["{'api_key': 'XYZZY13', 'model': 'm'}"], ["{'api_key': '***', 'model': 'm'}"]),
    (["https://user:XYZZY14@host/v1"], [f"https://user:{MASK}@host/v1"]),
    (["https://host/v1?api_key=XYZZY15&model=m"], [f"https://host/v1?api_key={MASK}&model=m"]),
    (["--extra={\"token\": \"XYZZY16\"}"], ['--extra={"token": "***"}']),
    (['{"auth": {"user": "u", "pass": "XYZZY17"}}'], ['{"auth": "***"}']),
]

KEPT = [
    ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--port", "8000", "-tp", "2"],
    ["--max-num-batched-tokens", "8192", "--max-tokens", "64", "--tokenizer", "tok/x"],
    ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3, "model": "m"}'],
    ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'],
    ["--ssl-keyfile", "/etc/ssl/key.pem", "KEYBOARD=us", "--monkey", "1"],
    ["--enable-auth", "--port", "8000"],  # a secret-named switch does not hide the next flag
    ["python", "-c", "print({'a': 1})", "-1"],
]


@pytest.mark.parametrize("argv, want", MASKED)
def test_masked(argv, want):
    got = mask_argv(argv)
    assert got == want
    assert not any("XYZZY" in a for a in got)


@pytest.mark.parametrize("argv", KEPT)
def test_kept(argv):
    assert mask_argv(argv) == argv


@pytest.mark.parametrize("name, secret", [
    ("api_key", True), ("apiKey", True), ("X-Api-Key", True), ("HF_TOKEN", True), ("Authorization", True),
    ("secret-key", True), ("db_password", True), ("accessToken", True),
    ("num_speculative_tokens", False), ("max-num-batched-tokens", False), ("tokenizer", False),
    ("ssl-keyfile", False), ("kv_role", False), ("monkey", False),
])
def test_key_names(name, secret):
    assert is_secret_key(name) is secret


def test_record_masks_header_cmd_and_proc_start_argv(tmp_path):
    """End to end: the secrets of MASKED on a recorded command line reach neither the
    header's ``cmd`` nor any process's ``proc.start.argv`` (the whole file is searched)."""
    args = [a for argv, _ in MASKED for a in argv]
    out = tmp_path / "t.jsonl"
    r = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(out), "--",
                        sys.executable, "-c", "pass", *args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PDTRACE_HOOKS="0"))
    assert r.returncode == 0, r.stderr
    assert "XYZZY" not in r.stderr  # record's own "recording ..." line
    text = out.read_text()
    assert "XYZZY" not in text
    tr = load(str(out))
    assert "--api-key" in tr.header["cmd"] and MASK in tr.header["cmd"]
    starts = [e for e in tr.events if e["ev"] == "proc.start"]
    assert starts and "--secret-key" in starts[0]["argv"]
