"""Bundled sample traces (data only: `pdtrace demo` reads demo_lookahead_misalignment.jsonl; provenance in
sample_traces/README.md). A package so that a wheel carries it as package data."""
