"""Where each hooked function is in a vLLM release's own code (issue 49), for the traces recorded
before hooks.status carried ``where``: python scripts/vllm_where.py [--write]

Run with a release's Python (PYTHONPATH=<this clone>; scripts/release_venv.sh VERSION, or .venv for
0.32.0): imports each hook's target the way the recorder resolves it (its primary form, then the
other releases' layouts), and reads the function's file (under the vllm package) and first line.
Prints {"vllm": VERSION, "hooks": {hook: [file, line, qualname]}}; --write merges it into
pdtrace/detectors/vllm_where.json under "releases" -> VERSION (nothing else is in that file, and
nothing in it is typed by hand).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "pdtrace", "detectors", "vllm_where.json")


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.path.insert(0, ROOT)
    import vllm

    from hooks import install
    from pdtrace import hooks

    hooks.load_subsystems()
    version = vllm.__version__.split("+")[0]
    out = {}
    for name, spec in sorted(hooks.REGISTRY.items()):
        status, _reason, form = install.check_form(spec)
        if status != "ok" or form is None:
            continue
        module, qualname, _params = form
        _owner, _attr, fn = install._resolve(module, qualname, importlib.import_module(module))
        w = install.source_of(fn, qualname)
        if w:
            loc, _, q = w.partition(" ")
            path, _, line = loc.rpartition(":")
            out[name] = [path, int(line), q]
    doc = {"vllm": version, "hooks": out}
    print(json.dumps(doc))
    if "--write" in argv:
        try:
            with open(TABLE, encoding="utf-8") as fh:
                table = json.load(fh)
        except (OSError, ValueError):
            table = {}
        table.setdefault("about", "vLLM source locations of the hooked functions per release, read from each "
                                  "release's own code by scripts/vllm_where.py (not typed by hand)")
        table.setdefault("releases", {})[version] = out
        table["releases"] = dict(sorted(table["releases"].items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))
        with open(TABLE, "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=1, sort_keys=False)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
