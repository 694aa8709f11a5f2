"""A directory of per-process shards as one in-memory ``TraceIndex`` (``pdtrace view DIR``).
No Textual, no vLLM."""

from __future__ import annotations

import os
from typing import Any

from .. import __version__, schema
from ..errors import TraceError
from .trace_index import TraceIndex
from ..tracefile.trace import Problem


def load_shards(directory: str) -> TraceIndex:
    """Merge a directory of per-process shards (``*.pdshard`` frames as a recording writes
    them, or ``*.jsonl`` event lines; no header/footer) in memory, sorted by ``t``, and index
    the result. Unreadable frames/lines and invalid events become problems naming the file."""
    from ..record.shards import read_shard, shard_files
    from ..tracefile.trace import derive_block_lists

    files = shard_files(directory)
    if not files:
        raise TraceError(directory, 0, "no shards (*.pdshard or *.jsonl) in this directory")
    events: list[dict[str, Any]] = []
    problems: list[Problem] = []
    for p in files:
        name = os.path.basename(p)
        got, probs = read_shard(p)
        problems.extend(probs)
        for obj in got:
            if obj.get("ev") in (schema.HEADER, schema.FOOTER):
                continue
            reason = schema.validate_event(obj)
            if reason is not None:
                problems.append(Problem(0, f"{name}: {reason}"))
                continue
            obj.pop("id", None)
            events.append(obj)
    events.sort(key=lambda e: e["t"])
    for i, e in enumerate(events):
        e["id"] = i
    derive_block_lists(events)
    header = {
        "ev": schema.HEADER, "schema": schema.SCHEMA_NAME, "schema_version": schema.SCHEMA_VERSION,
        "pdtrace": __version__, "versions": {}, "cmd": [], "host": "", "created": "",
        "redacted": True, "origin": "merge",
        "instances": sorted({e.get("inst", "-") for e in events}),
    }
    return TraceIndex.from_events(events, header, problems=problems, source=directory)
