"""Raw-event search of the lazy index (``pdtrace.index.search``), used by the TUI's ``e`` key:
checked against a brute-force scan of the parsed events, forwards and backwards, with chunks
small enough that matches straddle chunk boundaries, on a file-backed and an in-memory index."""

from pathlib import Path

import orjson
import pytest

from pdtrace.index.trace_index import TraceIndex
from pdtrace.index.search import search

SAMPLE = Path(__file__).resolve().parent.parent / "sample_traces" / "stale_read_rowmoves_buggy.jsonl"


def _lines(idx: TraceIndex) -> list[bytes]:
    with open(idx.path, "rb") as f:
        data = f.read()
    return [data[idx.starts[i]: idx.starts[i] + idx.lengths[i]].lower() for i in range(len(idx))]


def _brute(lines: list[bytes], text: str, start: int, direction: int) -> int | None:
    rng = range(start, len(lines)) if direction > 0 else range(start, -1, -1)
    return next((i for i in rng if text.lower().encode() in lines[i]), None)


@pytest.fixture(scope="module")
def idx():
    i = TraceIndex(str(SAMPLE)).build()
    yield i
    i.close()


@pytest.mark.parametrize("chunk", [64, 997, 4 << 20])
@pytest.mark.parametrize("text", ["acc.read", "BATCH.SWAP", '"row":3', "d2h.done", "no such text anywhere"])
def test_search_equals_a_brute_force_scan(idx, chunk, text):
    lines = _lines(idx)
    n = len(lines)
    for start in (0, 1, n // 3, n // 2, n - 2, n - 1):
        for direction in (1, -1):
            got = search(idx, text, start, direction, chunk=chunk)
            assert got == _brute(lines, text, start, direction), (text, start, direction, chunk)


def test_search_by_event_id_and_in_memory(idx):
    n = len(idx)
    assert search(idx, "#5") == idx.ordinal(5)
    assert search(idx, f"#{n + 10}") is None
    events = [orjson.loads(orjson.dumps(idx.event(i))) for i in range(n)]
    mem = TraceIndex.from_events(events, idx.header)
    lines = [orjson.dumps(e).lower() for e in events]
    for text in ("acc.truth", "batch.condense"):
        for start in (0, n // 2, n - 1):
            for d in (1, -1):
                assert mem.search(text, start, d) == _brute(lines, text, start, d)
