"""Test support: a P/D harness on real vLLM scheduler code (``pdtrace.testing.pd_harness``).

Importing this package does not import vLLM; the harness module does, lazily, when used.
"""
