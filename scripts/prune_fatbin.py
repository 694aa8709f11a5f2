#!/usr/bin/env python3
"""Zero the device code a CUDA library carries for other GPUs, so that it compresses to fit a call.

    python scripts/prune_fatbin.py LIB.so OUT.so [--sm 90]

For scripts/gpu_bundle.sh: a lent GPU machine takes at most 64 MiB per call, and vLLM 0.24.0's kernel
library (`_C_stable_libtorch.abi3.so`, 110 MB) compresses only to 81 MB, its `.nv_fatbin` section being
cubins for sm_75 to sm_120 (already compressed by nvcc). A cubin runs only on its own major
architecture, so on a Hopper GPU (sm_90) the driver can load only the sm_90 cubins or JIT a PTX of
compute_90 or below. This keeps those and every fatbin/entry header, and overwrites the payloads of
the other entries with zeros in place: the file's layout, sizes and symbols are unchanged, the
zeros compress to nothing. An entry the driver could pick on sm_90 is never touched. Prints what
it kept and zeroed; exit 2 when the file has no .nv_fatbin or a fatbin header does not parse.
"""

from __future__ import annotations

import argparse
import collections
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2


def _sections(d: bytes) -> dict[str, tuple[int, int]]:
    if d[:4] != b"\x7fELF" or d[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    sh = [struct.unpack_from("<IIQQQQ", d, shoff + i * shentsize) for i in range(shnum)]
    stroff = sh[shstrndx][4]
    return {d[stroff + s[0]: d.index(b"\0", stroff + s[0])].decode(): (s[4], s[5]) for s in sh}


def prune(data: bytearray, sm: int) -> dict:
    """Zero, in place, every entry payload an sm_<sm> GPU cannot use. Returns byte counts per (kind, arch)."""
    secs = _sections(data)
    if ".nv_fatbin" not in secs:
        raise ValueError("no .nv_fatbin section")
    off, size = secs[".nv_fatbin"]
    pos, end = off, off + size
    kept, zeroed = collections.Counter(), collections.Counter()
    fatbins = 0
    while pos + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fatbins are 8-aligned; padding between them
            continue
        fatbins += 1
        e, fend = pos + hsz, pos + hsz + fsz
        if fend > end:
            raise ValueError(f"fatbin at {pos:#x} runs past its section")
        while e < fend:
            kind, _ever, ehsz, padded = struct.unpack_from("<HHIQ", data, e)
            arch, = struct.unpack_from("<I", data, e + 28)
            if ehsz < 32 or e + ehsz + padded > fend:
                raise ValueError(f"entry at {e:#x} does not parse (header {ehsz}, payload {padded})")
            usable = (kind == CUBIN and arch == sm) or (kind == PTX and arch <= sm)
            (kept if usable else zeroed)[(kind, arch)] += padded
            if not usable:
                data[e + ehsz: e + ehsz + padded] = bytes(padded)
            e += ehsz + padded
        pos = fend
    if not fatbins:
        raise ValueError("no fatbin in .nv_fatbin")
    return {"fatbins": fatbins, "kept": kept, "zeroed": zeroed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib")
    ap.add_argument("out")
    ap.add_argument("--sm", type=int, default=90, help="the GPU's architecture (90: H100 / H200)")
    a = ap.parse_args(argv)
    data = bytearray(open(a.lib, "rb").read())
    try:
        r = prune(data, a.sm)
    except (ValueError, struct.error, IndexError) as exc:
        print(f"prune_fatbin: {a.lib}: {exc}", file=sys.stderr)
        return 2
    open(a.out, "wb").write(data)
    name = {PTX: "ptx", CUBIN: "sm"}
    fmt = lambda c: ", ".join(f"{name.get(k, k)}_{s} {v / 1e6:.1f} MB" for (k, s), v in sorted(c.items()))  # noqa: E731
    print(f"prune_fatbin: {r['fatbins']} fatbins; kept {fmt(r['kept'])}; zeroed {fmt(r['zeroed'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
