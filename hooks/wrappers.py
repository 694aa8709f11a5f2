"""The recording wrappers every hook body goes through (``after``, ``before``, ``around``,
``patch_after``): the original's exceptions pass through untouched, an exception in pdtrace's
own recording code is counted (``Recorder.hook_error``) and never raised into vLLM. Where
it can, a wrapper is generated with the original's own parameter list (``_generate``)."""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import keyword
from typing import Any, Callable

from pdtrace.record import recorder as _recorder

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

