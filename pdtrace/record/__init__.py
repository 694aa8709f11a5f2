"""Recording: what runs inside the traced processes, and what joins their output.

``bootstrap`` starts a ``recorder.Recorder`` in every process `pdtrace record` spawns;
hooks (``pdtrace.hooks``) call ``Recorder.emit`` on the caller's thread; the recorder's
writer thread resolves deferred values (``materialize``), redacts (``redact``), checks
online (``online``, the flight recorder) and appends ``frames`` to per-process shards
(``ring`` keeps only a window of them); ``shards`` joins the shards into one trace file
(through ``pdtrace.tracefile.writer``).
"""
