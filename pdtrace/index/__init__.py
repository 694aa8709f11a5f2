"""The viewer's lazy index of a trace: ``trace_index.TraceIndex`` keeps each event's byte
span and a few columns, reads events on demand (``blocks``: the text of a plain or
seekable ``.zst`` trace), searches raw lines (``search``), and indexes a directory of
shards (``shards``). No Textual, no vLLM.
"""


def __getattr__(name: str):  # the old module pdtrace.index's names (pdtrace._moved; gone in 0.3.0)
    import importlib

    from pdtrace import _moved

    if name in _moved.OLD_INDEX_NAMES:
        _moved.warn(f"pdtrace.index.{name}", f"pdtrace.index.trace_index.{name}")
        return getattr(importlib.import_module(__name__ + ".trace_index"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
