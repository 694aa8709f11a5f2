#!/usr/bin/env python3
"""Fetch vLLM's own KV-connector unit tests from the pinned release's sdist on PyPI (cached).

    python scripts/fetch_vllm_tests.py [--version 0.32.0] [--dest DIR]

Prints the directory that holds ``tests/`` of that release (``--dest``, default
``$PDTRACE_CACHE`` or ``~/.cache/pdtrace``, then ``vllm-src/vllm-<version>``). Nothing is
copied into this repository. The archive is located with PyPI's JSON simple API (PEP 691),
its sha256 checked against PyPI's, and only ``tests/`` is extracted: pip's sdist path would
build metadata (setuptools-rust, a "+cpu" local version), which is neither needed nor wanted.

Beside it, ``hf/`` is a Hugging Face cache holding one file: the config.json of
``facebook/opt-125m``, the model every scheduler in those tests is configured with. The
fields are transcribed from the config published on the Hugging Face hub; the tests build
schedulers and connectors only, never load weights or a tokenizer, and this machine cannot
reach the hub. Use it with ``HF_HOME=<dir>/hf HF_HUB_OFFLINE=1``.

Exit 0 and the path on stdout; exit 2 and one line on stderr when PyPI cannot be reached
or the archive does not match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

SIMPLE = "https://pypi.org/simple/vllm/"
KEEP = ("tests/",)  # the unit tests import helpers from across tests/ (tests.v1.core.utils, ...)

OPT_125M = {  # facebook/opt-125m config.json (transcribed; see the module docstring)
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}


def _sdist(version: str) -> tuple[str, str]:
    req = urllib.request.Request(SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    name = f"vllm-{version}.tar.gz"
    for f in index.get("files", []):
        if f.get("filename") == name:
            return f["url"], f["hashes"]["sha256"]
    raise LookupError(f"{SIMPLE}: no {name}")


def _hf_cache(root: Path) -> None:
    repo = root / "hf" / "hub" / "models--facebook--opt-125m"
    snap = repo / "snapshots" / "pdtrace-config-only"
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("pdtrace-config-only")
    (snap / "config.json").write_text(json.dumps(OPT_125M, indent=2) + "\n")


def fetch(version: str, dest: Path) -> Path:
    root = dest / "vllm-src" / f"vllm-{version}"
    done = root / ".complete"
    if not done.exists():
        url, sha = _sdist(version)
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, suffix=".tar.gz") as tmp:
            h = hashlib.sha256()
            with urllib.request.urlopen(url, timeout=300) as r:
                while chunk := r.read(1 << 20):
                    h.update(chunk)
                    tmp.write(chunk)
            tmp.flush()
            if h.hexdigest() != sha:
                raise ValueError(f"{url}: sha256 {h.hexdigest()} != PyPI's {sha}")
            prefix = f"vllm-{version}/"
            with tarfile.open(tmp.name) as tar:
                members = []
                for m in tar.getmembers():
                    rel = m.name[len(prefix):] if m.name.startswith(prefix) else ""
                    if (m.isfile() and any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP)):
                        m.name = rel
                        members.append(m)
                tar.extractall(root, members=members, filter="data")
        done.write_text(url + "\n")
    _hf_cache(root)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.32.0")
    ap.add_argument("--dest", default=os.environ.get("PDTRACE_CACHE") or str(Path.home() / ".cache" / "pdtrace"))
    a = ap.parse_args()
    try:
        print(fetch(a.version, Path(a.dest)))
    except Exception as e:  # one line, documented exit code
        print(f"fetch_vllm_tests: vLLM {a.version} tests not fetched: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
