"""Tiny model configs the harness and `pdtrace repro` write for vLLM (data only). A package so that a wheel carries
them as package data."""
