"""The viewer's lazy index of a trace: ``trace_index.TraceIndex`` keeps each event's byte
span and a few columns, reads events on demand (``blocks``: the text of a plain or
seekable ``.zst`` trace), searches raw lines (``search``), and indexes a directory of
shards (``shards``). No Textual, no vLLM.
"""
