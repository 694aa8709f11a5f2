"""Open report.html in a real headless Chromium, from disk, with the network off.

Chromium runs with --dump-dom after a 10 s virtual-time budget; plotly renders each
figure into an <svg class="main-svg">. The page sets body[data-pd-rendered] to the number
of figures drawn once every Plotly.newPlot resolved. A screenshot is saved next to the
report (and copied to $PDTRACE_SCREENSHOT_DIR when set) so a person can look at it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

from pdtrace.commands import report as report_cmd  # noqa: E402
from pdtrace.viewers.html import report  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(bc.find_chromium() is None,
                       reason="headless Chromium not installed (Debian: apt-get install -y chromium)"),
]


def _check_rendered(dom: str, page: str) -> None:
    n_figs = len(report.unpack_data(page)["figs"])
    m = re.search(r'<body[^>]*data-pd-rendered="(\d+)"', dom)
    err = re.search(r'<body[^>]*data-pd-error="([^"]*)"', dom)
    assert err is None, f"figure rendering failed in Chromium: {err.group(1)}"
    assert m is not None, "the page never finished rendering its figures"
    assert int(m.group(1)) == n_figs
    # every figure div got a plotly SVG
    assert dom.count('class="main-svg"') >= n_figs
    for fid in report.unpack_data(page)["figs"]:
        i = dom.index(f'id="{fid}"')
        assert "js-plotly-plot" in dom[max(0, i - 300): i + 300], f"{fid} was not turned into a plot"


def _shot(tmp: Path, name: str, html: Path) -> Path:
    shot = tmp / name
    dom = bc.render_with_chromium(html, screenshot=shot)
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("PDTRACE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / name)
    return shot, dom


def test_report_renders_in_chromium_offline(tmp_path):
    trace = bc.write_buggy_trace(tmp_path / "buggy.jsonl")
    html = tmp_path / "report.html"
    assert report_cmd.run(Path(trace), html, lenient=False) == 0
    _shot_path, dom = _shot(tmp_path, "report-buggy.png", html)
    _check_rendered(dom, html.read_text(encoding="utf-8"))
    assert "lookahead-block-misalignment" in dom  # the findings table is there too


def test_large_report_renders_in_chromium(tmp_path):
    trace = bc.write_large_trace(tmp_path / "large.jsonl", 60_000)
    html = tmp_path / "large.html"
    assert report_cmd.run(Path(trace), html, lenient=False) == 0
    _shot_path, dom = _shot(tmp_path, "report-large.png", html)
    _check_rendered(dom, html.read_text(encoding="utf-8"))
