"""The help screen (``?``)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# pdtrace view

Replays a trace and shows where P/D + speculative decoding went wrong.

| key | does |
| --- | --- |
| `left` / `right` | previous / next engine step |
| `home` / `end` | first / last step |
| `f` / `F` | next / previous finding (jumps to its request and step) |
| `enter` | on a finding: jump to it; on a request: select it |
| `/` | filter requests by id |
| `D` | run the detectors on a trace too large to run them automatically (> 256 MiB) |
| `1` `2` `3` `4` | Block map, Accepted counts, Connector metadata, Raw events |
| `tab` / `shift+tab` | move focus between lists and panes |
| `ctrl+p` | command palette: go to request / step / finding |
| `?` | this help |
| `q` | quit |

**Block map**: P's reported blocks next to D's local blocks per KV group, each with
the token range it holds. `LA` marks lookahead blocks (hold no computed tokens);
`local <- remote` pairs that do not hold the same tokens are red.

**Accepted counts**: per InputBatch row, the D2H copy (issued / completed), the CPU
read (value, time, whether the copy's event had completed), the row's owners over time
(batch add / swap / condense / remove), and the authoritative value. Stale and wrong-row
reads are red.

**Connector metadata**: bind, the target layers, clear, the drafter layers and their
save_kv_layer calls; a clear before the drafter and layers that never saved are red.

Press `escape` or `?` to close.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 95%; height: 80%; border: thick $accent; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close", show=False)]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)
