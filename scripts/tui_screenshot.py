#!/usr/bin/env python3
"""Save the viewer's screen as SVG after some keys (docs/screenshots), from a checkout:

    python scripts/tui_screenshot.py SAMPLE OUT.svg [KEY ...]
    chromium --headless --no-sandbox --hide-scrollbars --force-device-scale-factor=1.6 \\
        --window-size=994,636 --screenshot=OUT.png file://$PWD/OUT.svg

SAMPLE is a name in sample_traces/ (without .jsonl); the terminal is 80x24; KEYs are Textual
key names (f, e, full_stop, enter, ...), pressed once the detectors have reported. The SVG is
Textual's own screenshot (what `S` saves in the viewer).
"""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdtrace.index.trace_index import TraceIndex  # noqa: E402
from pdtrace.viewers.tui.app import PdtraceViewer  # noqa: E402


async def shoot(sample: str, out: str, keys: list[str]) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    app = PdtraceViewer(TraceIndex(os.path.join(root, "sample_traces", f"{sample}.jsonl")))
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(300):
            if app.findings_done:
                break
            await pilot.pause(0.02)
        for k in keys:
            await pilot.press(k)
            await pilot.pause(0.1)
        await app.workers.wait_for_complete()
        await pilot.pause(0.3)
        app.save_screenshot(filename=os.path.basename(out), path=os.path.dirname(os.path.abspath(out)))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    asyncio.run(shoot(sys.argv[1], sys.argv[2], sys.argv[3:]))
