"""The help screen (``?``)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# pdtrace view

Press `escape` or `?` to close this help, `q` to quit.

Replays a trace and shows where P/D + speculative decoding went wrong.

| key | does |
| --- | --- |
| `left` / `right` | previous / next engine step |
| `home` / `end` | first / last step |
| `f` / `F` | next / previous finding, by its number (1, 2, 3 as `check` numbers them; jumps to its request, step and pane) |
| `n` / `N` | next / previous step at which the selected request has events |
| `enter` | on a finding: jump to it; on a request: select it |
| `/` | filter findings and requests (kind, request, instance, title); `escape` there clears it and leaves |
| `e` | search the raw events (text, kind, request, `#id`): in the search line Enter or `↓` next match, `↑` previous, `esc` closes it (then `E`: previous match); the match is shown first in the Raw tab |
| `g` | group findings by bug class / by request |
| `s` | show / hide the left column (hidden by default under 100 columns) |
| `c` | copy the selected finding as Markdown (clipboard, and a .md file in the working directory) |
| `S` | save the screen as SVG in the working directory |
| `D` | run the detectors in the viewer's process over every event parsed (a trace over 256 MiB is checked in a background process instead, in bounded memory; D is for when that failed) |
| `1` ... `5` | Block map, Accepted counts, Connector metadata, Drafter window, Raw events |
| `tab` / `shift+tab` | move focus between lists and panes |
| `ctrl+p` | command palette: go to request / step / finding |
| `?` | this help |
| `q` | quit |

Keys pressed while the trace is still being indexed are kept: `f` jumps to the first
finding as soon as the detectors report.

**Findings** (left): one line each, grouped by bug class. Every class has a header with
its coverage: `✓ checked: clean`, `– does not apply: why`, or `? not checked: why` (the
trace cannot decide it; never read that as clean). Under kv-never-crossed, per instance
pair, where D's prompt tokens came from: computed on D, loaded from P, D's own prefix cache.

**Step scrubber**: `┃` (red) steps with findings, `✗` (yellow) steps where the scheduler
handled KV that failed to load (a finding's `┃` wins a shared cell), `╵` steps where the
selected request has events, `◆` the selected step.

**Block map**: P's reported blocks next to D's local blocks per KV group, each with
the token range it holds. `LA` marks lookahead blocks (hold no computed tokens);
`✗ LOAD FAILED sN`, a D block whose KV failed to load at step N (the box above it says what
the scheduler did, as `pdtrace check` does);
`local <- remote` pairs that do not hold the same tokens are red, the reason under them.
Each group's heading says how many of the tokens D loaded reached it; a sliding-window group
says how many fell before its in-window tail, and a group outside the transfer groups is
marked NOT A TRANSFER GROUP (its blocks hold tokens D counts computed that nothing wrote).
When the pair's drafter writes past its allocation, its window is drawn here too.

**Accepted counts**: per CPU read of num_accepted_tokens: row, request and verdict first
(STALE / WRONG ROW / WRONG VALUE in red, each reason on a line of its own), then as many
detail columns as fit (value, authoritative value, the row's owner when the D2H copy was
issued and now, copy issue / completion times relative to the read); the rest go on a
dim line under the row, with the row's owners over time.

**Connector metadata**: bind, the target layers, clear, the drafter layers and their
save_kv_layer calls; a clear before the drafter and layers that never saved are red.

**Drafter window**: each `spec.window` of the request -- the positions the drafter writes
KV for -- over the blocks it owns: a strip of the positions (green inside the allocation,
red past it, `│` at block boundaries) and one line per block index; past the allocation,
the block-table entry the write would hit and who holds that block (a shared
prefix-cache block).

A pane longer than the screen scrolls: `tab` until it has the focus, then `↑` / `↓`, `PageUp` /
`PageDown`, `Home` / `End`, or the mouse wheel. Wide tables scroll sideways (the scrollbar under
them, or shift + mouse wheel).

Press `escape` or `?` to close.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 95%; height: 80%; border: thick $accent; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close", show=False),
                Binding("q", "app.quit", "Quit")]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)
