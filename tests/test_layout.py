"""The shape of the code (issue 35): pdtrace/ shows its layers, no module outgrows the guide,
and no import goes in a circle.

The imports are read from the source with ``ast`` (every ``import`` / ``from ... import``,
module level or inside a function: a lazy import that closes a circle is still one), each
resolved to the module it names in pdtrace/, hooks/ (installed as ``pdtrace.hooks``) or
viewers/ (``pdtrace.viewers``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"pdtrace": "pdtrace", "hooks": "pdtrace.hooks", "viewers": "pdtrace.viewers"}
MAX_TOP_LEVEL = 8  # pdtrace/*.py
MAX_LINES = 450  # any module but the schema (a table of kinds)
LONG_OK = {"pdtrace/schema.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for top, name in PACKAGES.items():
        for p in sorted((ROOT / top).rglob("*.py")):
            parts = [name, *p.relative_to(ROOT / top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` (the module at ``path``) imports."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # "from pkg import module"
    return {m for m in out if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circle():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert len(graph) > 100  # (the walk found the code)
    assert "pdtrace.tracefile.trace" in graph["pdtrace.detectors.checking"]
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    """The check above would catch the circle issue 35 found (errors -> detectors.coverage ->
    detectors.index -> trace -> errors), here as a graph."""
    graph = {"errors": {"coverage"}, "coverage": {"dindex"}, "dindex": {"trace"}, "trace": {"errors", "schema"},
             "schema": set()}
    assert _cycles(graph) == [["coverage", "dindex", "errors", "trace"]]
    graph["trace"] = {"schema"}
    assert _cycles(graph) == []


def test_errors_imports_nothing_of_pdtrace_but_its_version():
    mods = _modules()
    assert _imports("pdtrace.errors", mods["pdtrace.errors"], set(mods)) <= {"pdtrace"}


def test_pdtrace_top_level_is_small_and_modules_are_short():
    top = sorted(p.name for p in (ROOT / "pdtrace").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    long = {}
    for top_dir in (*PACKAGES, "scripts"):
        for p in (ROOT / top_dir).rglob("*.py"):
            rel = p.relative_to(ROOT).as_posix()
            n = len(p.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES and rel not in LONG_OK:
                long[rel] = n
    assert long == {}


def test_every_package_is_in_the_wheel():
    """pyproject's ``packages`` lists every package directory (one left out is missing from an
    installed pdtrace; a fresh clone's CI caught ``pdtrace.index`` misnamed there)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in PACKAGES.items():
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(ROOT / top).parts]))
    assert found == listed
