"""Redaction: what may be written into a trace meant to be attached to a public bug report."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

MASK = "***"
# flags whose next argument is a secret, and KEY=VALUE pairs whose key looks secret
_SECRET_FLAGS = re.compile(r"^--?(api[-_]?key|token|hf[-_]token|password|secret|auth[-_a-z]*)$", re.I)
_SECRET_KV = re.compile(r"^(--?)?([A-Za-z0-9_.-]*(KEY|TOKEN|SECRET|PASSWORD|PASSWD|AUTH)[A-Za-z0-9_]*)=(.+)$", re.I)
_URL_CRED = re.compile(r"(://[^/:@\s]+:)[^@/\s]+@")


def mask_argv(argv: Sequence[str]) -> list[str]:
    """Mask secret values in a command line: --api-key X, HF_TOKEN=..., user:pass@ in URLs."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        a = str(a)
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        if _SECRET_FLAGS.match(a):
            out.append(a)
            hide_next = True
            continue
        m = _SECRET_KV.match(a)
        if m:
            out.append(f"{m.group(1) or ''}{m.group(2)}={MASK}")
            continue
        out.append(_URL_CRED.sub(rf"\1{MASK}@", a))
    return out


def token_digest(token_ids: Sequence[int] | None) -> int | None:
    """CPython's hash of the ids as a tuple, or None for no ids: the cheap half of
    ``token_hash``, taken on the traced thread (one C-level pass, about 1.5k instructions for
    a 64-token prompt). Integer hashing is not randomized (PYTHONHASHSEED affects str and
    bytes only), and the tuple hash is the same on every 64-bit CPython since 3.8, so the
    P and D processes of one deployment agree. It is not a cryptographic hash: only
    ``digest_hash`` of it is written to a trace (the value sits in a shard file until
    ``pdtrace record`` merges it)."""
    if token_ids is None or len(token_ids) == 0:
        return None
    return hash(tuple(token_ids))  # numpy integers hash as the Python ints of the same value


def digest_hash(digest: int | None) -> str:
    """The written half of ``token_hash``: blake2b with an 8-byte digest of ``digest`` as
    8 little-endian bytes, 16 hex digits ("" for None)."""
    if digest is None:
        return ""
    h = _BLAKE2B_8.copy()  # a copy of a fresh state: the same as a new hasher, minus argument parsing
    h.update((digest & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    return h.hexdigest()


def token_hash(token_ids: Sequence[int] | None) -> str:
    """Short stable hash of a token id sequence (lets two traces say 'same prompt' without the
    prompt): ``digest_hash(token_digest(ids))``, i.e. blake2b-64 of CPython's tuple hash of
    the ids. Split in two so a hook pays only for the tuple hash; the blake2b step runs when
    the recorder's queue is materialized (``recorder.PROMPT``)."""
    return digest_hash(token_digest(token_ids))


_BLAKE2B_8 = hashlib.blake2b(digest_size=8)


def summarize_kv_params(params: Any) -> dict[str, Any] | None:
    """The parts of kv_transfer_params a trace keeps (no hosts/ports when redacting)."""
    if not isinstance(params, dict):
        return None
    out: dict[str, Any] = {}
    for k in ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
              "remote_num_tokens", "transfer_mode"):
        if params.get(k) is not None:
            out[k] = params[k]
    rb = params.get("remote_block_ids")
    if rb is not None:
        out["n_remote_blocks"] = [len(g) for g in rb] if rb and isinstance(rb[0], (list, tuple)) else len(rb)
    return out
