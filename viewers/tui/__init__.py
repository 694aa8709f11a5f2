"""Textual TUI for pdtrace traces (``pdtrace view``). Never imports vLLM or torch."""
