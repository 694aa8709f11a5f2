"""A wheel of pdtrace carries every file the package reads at run time. A new user's pass (2026-12-07) saw
setuptools warn about data directories, and the wheel then lacked ``pdtrace/detectors/vllm_where.json`` (the table
of vLLM's file:line per release that root causes name): `pip install .` would have dropped it silently
(causes._table falls back to an empty table). The oracle is git's list of tracked files, not pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the repository's top-level folders and where pyproject.toml's package-dir puts them in the wheel
PLACED = {"pdtrace": "pdtrace", "hooks": "pdtrace/hooks", "viewers": "pdtrace/viewers"}


def test_the_wheel_carries_every_tracked_file_of_the_package(tmp_path):
    files = subprocess.run(["git", "ls-files", *PLACED], cwd=ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip(f"not a git checkout: {files.stderr.strip()}")
    want = {PLACED[f.split("/", 1)[0]] + "/" + f.split("/", 1)[1] for f in files.stdout.split()
            if "/tests/" not in f and not f.endswith((".md", ".pyc"))}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", ".", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "absent from the `packages` configuration" not in r.stderr, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("pdtrace-*.whl")
    have = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(want - have)
    assert not missing, missing
    assert "pdtrace/detectors/vllm_where.json" in have
