"""Messages the indexing worker posts to the app (small dataclasses, one module)."""

from __future__ import annotations

import dataclasses
from typing import Any

from textual.message import Message

from pdtrace.index.trace_index import ScanProgress


@dataclasses.dataclass
class IndexProgress(Message):
    """A batch of lines was indexed (``progress.done`` on the last one)."""

    progress: ScanProgress


@dataclasses.dataclass
class IndexFailed(Message):
    """The trace cannot be read at all (bad header, unreadable file)."""

    error: str


@dataclasses.dataclass
class FindingsReady(Message):
    """The detectors ran over the whole trace (``error`` set when they could not)."""

    findings: list[Any]
    error: str = ""
    coverage: dict[str, Any] | None = None  # bug class -> detectors.coverage.Coverage
    notes: dict[str, list] | None = None  # bug class -> its facts (kv-never-crossed: per instance pair)


@dataclasses.dataclass
class DetectProgress(Message):
    """The detectors' child process has read ``fraction`` of the trace (``tui.detecting``)."""

    fraction: float


@dataclasses.dataclass
class SearchDone(Message):
    """A raw-event search finished: ``ordinal`` of the match, or None."""

    query: str
    ordinal: int | None
    direction: int
