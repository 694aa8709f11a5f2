"""pdtrace: trace and debug vLLM prefill/decode disaggregation (NIXL) with speculative decoding."""

__version__ = "0.1.0"
