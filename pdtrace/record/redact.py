"""Redaction: what may be written into a trace meant to be attached to a public bug report."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Sequence

MASK = "***"

# A key names a secret when one of its words (split at -, _, ., spaces and camelCase) is one
# of these, or its words run together hold one of the compounds: `--api-key`, `HF_TOKEN`,
# `apiKey`, `AWS_SECRET_ACCESS_KEY`, `Authorization`, `X-Api-Key`. Plural or longer words are
# not secrets: `--max-num-batched-tokens`, `num_speculative_tokens`, `--tokenizer`,
# `--ssl-keyfile` (a path), `keyboard`.
_SECRET_WORDS = frozenset({
    "key", "token", "secret", "password", "passwd", "pwd", "passphrase", "credential", "credentials",
    "auth", "authorization", "authentication", "bearer", "cookie", "apikey", "signature", "sig",
})
_SECRET_COMPOUNDS = ("apikey", "secretkey", "accesskey", "privatekey", "authtoken", "accesstoken",
                     "refreshtoken", "password", "passwd", "secret", "credential")
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# "KEY: value" (an HTTP header) as a whole argument
_HEADER = re.compile(r"^\s*([A-Za-z][\w-]*)\s*:\s*(\S.*)$", re.S)
# key=value / "key": value / 'key': 'value' anywhere in an argument (query strings, dict
# literals): every key is looked at, also one inside a value that is not a secret (a URL's query)
_KEYSEP = re.compile(r"""(["']?)([A-Za-z_][\w.-]*)\1(\s*[:=]\s*)""")
_VALUE = re.compile(r""""(?:[^"\\]|\\.)*"|'[^']*'|[^\s,;&}\]"']+""")
_SCHEME_TOKEN = re.compile(r"\b(Bearer|Basic|Token|Digest)(\s+)[^\s,;\"']+", re.I)
_URL_CRED = re.compile(r"(://[^/:@\s]+:)[^@/\s]+@")


def is_secret_key(name: str) -> bool:
    """Whether a flag / variable / JSON key / header name names a secret (see ``_SECRET_WORDS``)."""
    words = [w.lower() for w in _WORDS.findall(name)]
    if any(w in _SECRET_WORDS for w in words):
        return True
    joined = "".join(words)
    return any(c in joined for c in _SECRET_COMPOUNDS)


def _mask_json(obj: Any) -> tuple[Any, bool]:
    """``obj`` with every value under a secret key replaced by MASK (nested), and whether any was."""
    if isinstance(obj, dict):
        changed = False
        out = {}
        for k, v in obj.items():
            if isinstance(k, str) and is_secret_key(k) and v not in (None, "", MASK):
                out[k], changed = MASK, True
            else:
                out[k], c = _mask_json(v)
                changed = changed or c
        return out, changed
    if isinstance(obj, list):
        items = [_mask_json(v) for v in obj]
        return [v for v, _c in items], any(c for _v, c in items)
    if isinstance(obj, str):
        m = mask_text(obj)
        return m, m != obj
    return obj, False


def _mask_pairs(text: str) -> str:
    out: list[str] = []
    pos = 0
    for m in _KEYSEP.finditer(text):
        if m.start() < pos or not is_secret_key(m.group(2)):
            continue
        v = _VALUE.match(text, m.end())
        if v is None or v.group(0).strip("\"'") in ("", MASK):
            continue
        q = v.group(0)[0] if v.group(0)[0] in "\"'" else ""
        out.append(text[pos:m.end()] + q + MASK + q)
        pos = v.end()
    return "".join(out) + text[pos:] if out else text


def mask_text(text: str) -> str:
    """Mask secrets inside one argument: a JSON value (masked by key, nested), an HTTP header
    whose name is secret, ``Bearer X`` / ``Basic X``, ``key=value`` and ``"key": value``
    pairs with a secret key, and ``user:password@`` in URLs."""
    s = text.strip()
    if s[:1] in ("{", "[") and s[-1:] in ("}", "]"):
        try:
            obj = json.loads(s)
        except ValueError:
            pass
        else:
            masked, changed = _mask_json(obj)
            return json.dumps(masked, ensure_ascii=False) if changed else text
    m = _HEADER.match(text)
    if m and is_secret_key(m.group(1)):
        return f"{m.group(1)}: {MASK}"
    text = _SCHEME_TOKEN.sub(lambda t: f"{t.group(1)}{t.group(2)}{MASK}", text)
    text = _mask_pairs(text)
    return _URL_CRED.sub(rf"\1{MASK}@", text)


def mask_argv(argv: Sequence[str]) -> list[str]:
    """Mask secret values in a command line, by key name wherever a key is: the argument
    after a secret flag (``--api-key X``, ``--secret-key X``; not one that is itself a
    ``--flag``), ``--api-key=X``, ``HF_TOKEN=X``, JSON objects inside arguments
    (``{"api_key": "X"}``, nested), HTTP headers (``--header "Authorization: Bearer X"``),
    ``Bearer X`` anywhere, query strings (``?api_key=X``) and ``user:pass@`` in URLs.
    tests/test_redact.py lists what is masked and what is kept."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        a = str(a)
        if hide_next:
            hide_next = False
            if not a.startswith("--"):
                out.append(MASK)
                continue
        if a.startswith("-") and len(a) > 1 and not a[1:2].isdigit():
            flag, eq, value = a.partition("=")
            if is_secret_key(flag.lstrip("-")):
                if eq:
                    out.append(f"{flag}={MASK}")
                else:
                    out.append(a)
                    hide_next = True
                continue
            if eq:
                out.append(f"{flag}={mask_text(value)}")
                continue
            out.append(a)
            continue
        out.append(mask_text(a))
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
