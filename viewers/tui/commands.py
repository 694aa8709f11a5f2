"""Command palette provider: go to request / step / finding."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

MAX_HITS = 200


class TraceCommands(Provider):
    """Every finding, request and step of the open trace as palette commands."""

    def _items(self):
        app = self.app
        for k, f in enumerate(getattr(app, "findings", [])):
            yield f"go to finding: {f.kind} {f.req or ''} step {f.step}", partial(app.goto_finding, k), f.title
        index = getattr(app, "index", None)
        if index is None:
            return
        for req in list(index.req_names):
            yield f"go to request {req}", partial(app.goto_request, req), ""
        for s in app.query_one("StepScrubber").steps:
            yield f"go to step {s}", partial(app.goto_step, s), ""

    async def discover(self) -> Hits:
        for n, (text, cb, help_) in enumerate(self._items()):
            if n >= 30:
                break
            yield DiscoveryHit(text, cb, help=help_ or None)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        n = 0
        for text, cb, help_ in self._items():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), cb, help=help_ or None)
                n += 1
                if n >= MAX_HITS:
                    break
