"""The trace file: how a trace is written, read, typed and compressed.

``pdtrace.schema`` says what an event is; this package is the only code that touches the
bytes of a trace file. ``writer`` writes a whole trace (header, events, footer);
``trace`` loads one (``load``, ``scan``, ``read_header``); ``segments`` and ``reading``
read it in bounded memory; ``typecheck`` judges events against the schema; ``footer``
counts; ``compress`` / ``zsource`` handle ``.jsonl.zst``; ``ends`` reads the header and
footer without the events; ``damage`` says in words what a damaged trace lacks;
``versions`` reads the traced packages' versions for the header. No vLLM, no torch.
"""
