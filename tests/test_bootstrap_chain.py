"""pdtrace's bootstrap (`pdtrace/record/bootstrap/sitecustomize.py`, first on PYTHONPATH under
`pdtrace record`) runs the sitecustomize the program would have run without it, exactly
once; so does the live tests' start-up code (scripts/live_site), which pdtrace's chains to.
Real interpreters started with the real PYTHONPATH; the user's sitecustomize appends a line
to a file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pdtrace.record.bootstrap

ROOT = Path(__file__).resolve().parent.parent
BOOT = str(Path(pdtrace.record.bootstrap.__file__).parent)
LIVE_SITE = str(ROOT / "scripts" / "live_site")


def _start(tmp_path: Path, *path: str, record: bool = False) -> tuple[list[str], str]:
    user = tmp_path / "user"
    user.mkdir(exist_ok=True)
    marks = tmp_path / "marks.txt"
    (user / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['MARKS'], 'a') as fh:\n    fh.write(f'user {os.getpid()}\\n')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDTRACE_")}
    env.update(MARKS=str(marks), PYTHONPATH=os.pathsep.join([*path, str(user)]))
    code = "import os; print(os.getpid())"
    argv = [sys.executable, "-c", code]
    if record:
        env["PYTHONPATH"] = str(user)  # record puts its bootstrap first itself
        argv = [sys.executable, "-m", "pdtrace", "record", "-o", str(tmp_path / "t.jsonl"), "--", *argv]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pid = r.stdout.split()[0]  # the program's (under record, `record` itself runs the user's too)
    lines = marks.read_text().splitlines() if marks.exists() else []
    return [ln.split()[0] for ln in lines if ln.split()[1] == pid], r.stdout + r.stderr


def test_the_users_sitecustomize_runs_once_behind_the_bootstrap(tmp_path):
    assert _start(tmp_path, BOOT)[0] == ["user"]


def test_and_under_record(tmp_path):
    marks, out = _start(tmp_path, record=True)
    assert marks == ["user"], out
    assert (tmp_path / "t.jsonl").exists()


def test_the_live_site_chain_runs_each_once(tmp_path):
    """bootstrap -> scripts/live_site -> the user's: three start-up files, each run once."""
    marks, out = _start(tmp_path, BOOT, LIVE_SITE)
    assert marks == ["user"], out
    code = ("import sys; print([type(f).__name__ for f in sys.meta_path].count('_NixlBindingsFinder'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDTRACE_")}
    env["PYTHONPATH"] = os.pathsep.join([BOOT, LIVE_SITE])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "1", r.stdout + r.stderr  # live_site's finder installed once
