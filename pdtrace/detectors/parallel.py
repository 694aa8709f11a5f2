"""`check -j N` (issue 22): the detectors split between N processes by the event kinds they
read, each process parsing only the lines of its kinds.

A big trace's check is mostly JSON parsing and the detectors' loops, both per event, and
each detector reads a few kinds (``Stream.KINDS``). Every process reads the whole file
(lines are cheap: C-level passes), tells each line's kind from its first bytes
(``segments.LineFilter``: the writer puts ``ev`` first) and parses only its part's lines.
The first part is run in this process (it draws the progress line), the others in child
processes; their findings, coverage summaries and request sightings are merged. Each kind is
summarized by exactly one part, so the merged summary counts every event once.

The parts, by ``jobs`` (``UNITS`` in order; the last part takes the rest, and the kinds no
detector reads, by reading every line that is not another part's):

- 2: kv-invariant | the six rules (+ the rest)
- 3: kv-invariant | drafter-window | the other five (+ the rest)
- 4: kv-invariant | drafter-window | stale-read | the other four (+ the rest)
- ... up to 7: each alone (kv-never-crossed with the rest)

The KV invariant's model goes first: its loop costs about what the six rules' loops cost
together (bench/invariant.py), so at the default two processes each takes half.

Whatever the fast path cannot judge alone (a damaged line, no digest match, a line that
does not start the writer's way, an event without its id) sends the whole check back to
the one-process stream (``stream.run``), which reads the file through ``scan`` when needed:
the result is always that of ``-j 1``. A detector that asks for a kind its part did not read
is a pdtrace bug (``KindNotRead``), never a quietly different verdict;
``tests/test_parallel.py`` runs every sample and corpus trace both ways.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import signal
import sys
import traceback
from typing import Any

from ..tracefile.compress import is_zstd
from ..tracefile.reading import SEGMENT, Rescan, Unfiltered
from ..tracefile.segments import LineFilter
from ..tracefile.trace import ProgressFn, read_header
from . import (crossed, drafter_window, kv_invariant, kv_load, lease_verdict, lookahead, metadata, sort_key,
               stale_read)
from .index import Index
from .stream import STREAMS, Result, _run
from .stream import run as run_serial

# the units of work, heaviest first: a part runs one or more units' detectors
UNITS = (
    (kv_invariant.KV_INVARIANT,),
    (drafter_window.DRAFTER_WINDOW_OUTSIDE_ALLOCATION,),
    (stale_read.STALE_ACCEPTED_COUNT_READ,),
    (lookahead.LOOKAHEAD_MISALIGNMENT,),
    (metadata.METADATA_CLEARED_BEFORE_DRAFTER,),
    (kv_load.KV_LOAD_FAILURE_RECOVERY,),
    (crossed.KV_NEVER_CROSSED,),
)
MAX_JOBS = len(UNITS)
ALWAYS = ("sched.config",)  # every part reads the configs (block sizes, roles)
MIN_AUTO_BYTES = 64 << 20  # ``jobs=0`` (auto) splits a trace from this size on


class KindNotRead(AssertionError):
    """A detector asked a part for a kind the part did not read (a pdtrace bug)."""


def kinds_of(kind: str) -> tuple[str, ...]:
    """The event kinds the detector ``kind`` reads."""
    return STREAMS[kind].KINDS


class PartIndex(Index):
    """An ``Index`` that refuses the kinds its part did not parse (``KindNotRead``)."""

    def __init__(self, events: Any, configs: Any = None, *, reads: frozenset = frozenset()):
        super().__init__(events, configs)
        self.reads = reads

    def kind(self, name: str) -> list:
        if name not in self.reads:
            raise KindNotRead(name)
        return super().kind(name)

    def ordered_codes(self, kinds: Any) -> Any:
        kinds = tuple(kinds)
        missing = [k for k in kinds if k not in self.reads]
        if missing:
            raise KindNotRead(", ".join(missing))
        return super().ordered_codes(kinds)


class Part:
    """One process's share: its detectors (``only``), the kinds it parses (``keep``), the
    kinds it summarizes, and an ``Index`` that refuses the kinds it did not parse (all of it
    picklable, for a ``spawn`` start)."""

    def __init__(self, only: tuple[str, ...], reads: frozenset, summarize: Any, keep: LineFilter):
        self.only, self.reads, self.summarize, self.keep = only, reads, summarize, keep
        self.index = functools.partial(PartIndex, reads=reads)


def plan(only: Any, jobs: int, schema_version: int = 2) -> list[Part]:
    """The parts for ``jobs`` processes over the detectors of ``only`` (all when empty);
    fewer than two parts: run in one process."""
    from ..schema import KINDS as ALL

    units = [u for u in (tuple(k for k in unit if not only or k in only) for unit in UNITS) if u]
    jobs = min(jobs, MAX_JOBS, len(units))
    if jobs < 2:
        return []
    groups = [units[i] for i in range(jobs - 1)] + [tuple(k for u in units[jobs - 1:] for k in u)]
    needs = []
    for g in groups:
        ks = set(ALWAYS).union(*(kinds_of(k) for k in g))
        if schema_version >= 2 and "sched.alloc" in ks:
            ks.add("sched.free")  # (block lists derived from deltas: a freed request's list goes)
        needs.append(ks)
    parts, earlier = [], set()
    for i, (g, ks) in enumerate(zip(groups, needs)):
        if i < len(groups) - 1:
            parts.append(Part(g, frozenset(ks), ks - earlier, LineFilter(ks)))
        else:  # the rest: every line but the other parts' own kinds
            others = earlier - ks
            reads = frozenset(set(ALL) - others)
            parts.append(Part(g, reads, reads - earlier, LineFilter(others, exclude=True)))
        earlier |= ks
    return parts


def auto_jobs(path: str) -> int:
    """``jobs=0``: two processes for a trace of ``MIN_AUTO_BYTES`` or more (a ``.zst`` one:
    an eighth of that on disk; traces compress about tenfold) on a host that gives this
    process two CPUs or more, else one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        big = os.path.getsize(path) >= (MIN_AUTO_BYTES // 8 if is_zstd(path) else MIN_AUTO_BYTES)
    except OSError:
        big = False
    return 2 if big and cpus >= 2 else 1


def _one(path: str, part: Part, request: str | None, lenient: bool, progress: ProgressFn | None,
         size: int, header: dict | None = None) -> Result:
    was_enabled = gc.isenabled()
    gc.disable()  # (as stream.run)
    try:
        return _run(path, part.only, request, lenient, progress, size, True, part=part, header=header)
    finally:
        if was_enabled:
            gc.enable()


def _attempt(path: str, part: Part, request: str | None, lenient: bool, progress: ProgressFn | None,
             size: int, header: dict | None = None) -> tuple:
    """One part's pass: ("ok", its Result), or ("unfiltered",) / ("rescan",) when the part
    cannot judge the file alone (the one-process check reads it: fast path / scan)."""
    try:
        return ("ok", _one(path, part, request, lenient, progress, size, header))
    except Unfiltered:
        return ("unfiltered",)
    except Rescan:
        return ("rescan",)


def _child(conn: Any, path: str, part: Part, request: str | None, lenient: bool, size: int,
           header: dict | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops and kills its children
    try:
        msg = _attempt(path, part, request, lenient, None, size, header)
    except KindNotRead as exc:
        msg = ("bug", f"KindNotRead: {exc}")
    except Exception:  # the parent reads the file in one process instead
        msg = ("failed", traceback.format_exc(limit=4))
    conn.send(msg)
    conn.close()


def run(path: str, *, only: Any = (), request: str | None = None, lenient: bool = False,
        progress: ProgressFn | None = None, size: int = SEGMENT, jobs: int = 2,
        header: dict | None = None) -> Result:
    """``stream.run`` split over ``jobs`` processes (see the module docstring); the same
    ``Result``. ``header``: line 1 as ``read_header`` gave it (read here otherwise), handed on
    to every part."""
    if header is None:
        header = read_header(path)
    parts = plan(only, jobs, header.get("schema_version", 1)) if jobs >= 2 else []
    if not parts:
        return run_serial(path, only=only, request=request, lenient=lenient, progress=progress, size=size,
                          header=header)
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    children = []
    sys.stdout.flush()  # (a forked child flushes what it inherited when it exits)
    sys.stderr.flush()
    for part in parts[1:]:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, path, part, request, lenient, size, header), daemon=True)
        proc.start()
        send.close()
        children.append((proc, recv))
    try:
        results = [_attempt(path, parts[0], request, lenient, progress, size, header)]
    except BaseException:
        for proc, _recv in children:
            proc.kill()
            proc.join()
        raise
    for proc, recv in children:
        if results[0][0] != "ok":
            proc.kill()
            proc.join()
            continue
        try:
            results.append(recv.recv())
        except EOFError:  # the child died (killed, out of memory)
            results.append(("failed", f"exit code {proc.exitcode}"))
        proc.join()
    bugs = [r[1] for r in results if r[0] == "bug"]
    if bugs:
        raise AssertionError("check -j: " + "; ".join(bugs))
    if any(r[0] != "ok" for r in results):
        # a part met what only scan judges: the one-process fast path would too (straight to scan)
        scan = any(r[0] == "rescan" for r in results)
        return run_serial(path, only=only, request=request, lenient=lenient, progress=progress, size=size,
                          fast=not scan, header=header)
    return _merge([r[1] for r in results])


def _merge(results: list[Result]) -> Result:
    """The parts' results as one ``Result`` (the first part's header, footer and problems):
    findings in the order ``stream.run`` gives."""
    mine = results[0]
    for other in results[1:]:
        mine.summary.merge(other.summary)
        mine.notes.update(other.notes)
        if mine.request is not None and other.request is not None:
            mine.request.merge(other.request)
    found = lease_verdict.reconcile([f for r in results for f in r.findings], mine.notes, mine.header)
    if mine.request is not None and mine.request.request is not None:
        from . import _about

        found = [f for f in found if _about(f, mine.request.wanted())]
    order = {k: i for i, k in enumerate(STREAMS)}
    found.sort(key=lambda f: order.get(f.kind, len(order)))  # (stable: each detector's own order)
    found.sort(key=sort_key)
    mine.findings = found
    mine.n_events = mine.summary.n_events()
    mine.jobs = len(results)
    return mine
