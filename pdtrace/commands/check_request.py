"""`pdtrace check --request`: the one request id of the trace that what the user typed names."""

from __future__ import annotations

import sys

from ..detectors import stream
from ..errors import PdtraceError


def resolve_request(path: str, request: str, reqs: list[str]) -> str:
    """The one request id of the trace that ``request`` names: a unique prefix of it (the id the
    client has, vLLM's external id, is the front of the engine's ``EXTERNAL-0-HASH``); else one
    line naming the matches (ambiguous) or the closest ids (unknown)."""
    import difflib

    known = sorted(set(reqs), key=stream.natural_key)
    hits = [r for r in known if request and r.startswith(request)]
    if len(hits) == 1:
        print(f"pdtrace: request {request!r} is {hits[0]!r}", file=sys.stderr)
        return hits[0]
    if hits:
        raise PdtraceError(f"{path}: request {request!r} is ambiguous: {len(hits)} requests start with it: "
                           f"{', '.join(hits[:5])}" + (" ..." if len(hits) > 5 else "") + "; give more of the id")
    close = difflib.get_close_matches(request, known, n=3, cutoff=0.6)
    raise PdtraceError(f"{path}: request {request!r} does not appear in the trace"
                       + (f"; closest: {', '.join(close)}" if close else
                          f"; none near it among its {len(known)} request(s), e.g. {', '.join(known[:2])}" if known
                          else ""))
