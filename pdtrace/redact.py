"""Redaction: what may be written into a trace meant to be attached to a public bug report."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

import orjson

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


def token_hash(token_ids: Sequence[int] | None) -> str:
    """Short stable hash of a token id sequence (lets two traces say 'same prompt' without the
    prompt): blake2b with an 8-byte digest of the ids as a compact JSON array, ``[1,2,3]``.

    orjson writes the array in C at a few instructions per id (packing int64s, with struct or
    array, parses each id as an argument: several times the cost), and the text of typical
    token ids is shorter than 8 bytes each, so there is less to hash too."""
    if token_ids is None or len(token_ids) == 0:
        return ""
    try:
        data = orjson.dumps(token_ids)
    except TypeError:  # not a list / tuple of Python ints (e.g. a numpy array): the same text
        data = orjson.dumps([int(t) for t in token_ids])
    h = _BLAKE2B_8.copy()  # a copy of a fresh state: the same as a new hasher, minus argument parsing
    h.update(data)
    return h.hexdigest()


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
