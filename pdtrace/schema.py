"""The pdtrace event schema: the single source of truth for every event kind.

A trace is JSON Lines. Line 1 is the header (``ev == "trace.header"``), the last line
is the footer (``ev == "trace.footer"``), and every line in between is one event.
Every event is a flat JSON object with the COMMON fields below plus the fields of its
kind. Nothing else in pdtrace defines event kinds: hooks emit through
``Recorder.emit(kind, ...)`` with a name from ``KINDS``, the loader validates against
``KINDS``, detectors and viewers read the field names documented here, and
docs/trace-format.md is generated from this module (``python -m pdtrace.schema``)
and checked against it by a test.

Conventions
- Times: ``t`` is ``time.monotonic_ns()`` of the emitting process (CLOCK_MONOTONIC is
  shared by all processes of one host); ``w`` is the wall-clock anchor of the same
  instant in ns since the epoch (the process's wall/monotonic offset is taken once at
  start, so ``w - t`` is constant per process). ``pdtrace merge`` aligns two hosts on
  ``w``.
- ``id`` is the event's ordinal in the merged trace (0 = first event after the header).
  Findings cite events by ``id``.
- Per KV cache group values are lists indexed by group: ``block_ids[g]``.
- ``sim: true`` marks an event produced by a documented simulation (worker-side code
  that needs a GPU), never by a live hook. Absent means live.
- Redaction (default): no prompt text and no token ids are stored, only lengths and
  a short hash.
- pdtrace's writer puts ``ev`` first (a line starts ``{"ev":"KIND"``): ``check -j`` tells
  a line's kind from its first bytes and parses only the kinds each process needs. A
  line written otherwise is still read (the check then runs in one process).
- A ``.jsonl.zst`` trace holds the same lines, zstd-compressed in zstd's seekable
  format (independent frames of 4 MiB uncompressed, then the seek table in a skippable
  frame): any zstd decoder reads it; ``pdtrace info`` reads only its last frame, and
  ``pdtrace view`` reads events by their offsets in the uncompressed lines, decompressing
  only the frames that hold them; a damaged frame there is skipped to the next one (the
  seek table says where), and the problem says how many bytes were lost (the lines after it
  are numbered as if the gap were one line); the findings that
  cite an event after it are inconclusive (the lost lines may be what makes them).
  The loader (``check``, ``report``, ``merge``, ``info --full``) reads on past a damaged frame
  the same way with ``--lenient``.
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from typing import Any

SCHEMA_NAME = "pdtrace"
SCHEMA_VERSION = 2

HEADER = "trace.header"
FOOTER = "trace.footer"

# Process roles.
ROLE_MAIN = "main"  # the launched command before vLLM says what it is
ROLE_API = "api"
ROLE_ENGINE = "engine-core"
ROLE_WORKER = "worker"
ROLES = (ROLE_MAIN, ROLE_API, ROLE_ENGINE, ROLE_WORKER)

# Instance ids: which side of a P/D deployment a process belongs to.
INST_P = "P"
INST_D = "D"
INST_BOTH = "PD"  # kv_both
INST_NONE = "-"  # no KV connector configured

# Model phases for connector metadata / spec decode events.
PHASE_TARGET = "target"
PHASE_DRAFTER = "drafter"


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str  # documentation type: int, str, bool, float, list[int], list[list[int]], dict, ...
    doc: str
    required: bool = True


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    doc: str
    fields: tuple[Field, ...] = ()
    hook: str = ""  # which hook module emits it ("" = recorder / tools)

    @property
    def required(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields if f.required)


def F(name: str, type: str, doc: str, required: bool = True) -> Field:
    return Field(name, type, doc, required)


COMMON: tuple[Field, ...] = (
    F("ev", "str", "event kind, one of the kinds below"),
    F("t", "int", "monotonic ns (time.monotonic_ns) of the emitting process"),
    F("w", "int", "wall-clock ns since the epoch for the same instant (anchor + t)"),
    F("pid", "int", "emitting process id"),
    F("role", "str", "process role: main | api | engine-core | worker"),
    F("inst", "str", "instance: P | D | PD (kv_both) | - (no connector); env PDTRACE_INSTANCE overrides"),
    F("rank", "int", "TP rank of a worker process", required=False),
    F("step", "int", "engine step number where known (scheduler's schedule() count, per instance)", required=False),
    F("req", "str", "request id where the event concerns one request", required=False),
    F("id", "int", "ordinal of the event in the merged trace (assigned by merge)", required=False),
    F("sim", "bool", "true when the event was produced by a documented simulation, not a live hook", required=False),
)

_KINDS: tuple[Kind, ...] = (
    # --- process / recorder ------------------------------------------------------------
    Kind("proc.start", "A traced Python process started recording.", (
        F("argv", "list[str]", "process argv, secrets masked"),
        F("ppid", "int", "parent pid"),
        F("python", "str", "Python version"),
        F("session", "str", "recording session id"),
    )),
    Kind("proc.role", "The process learned its role / instance (from vLLM objects it constructs).", (
        F("new_role", "str", "the role from now on"),
        F("new_inst", "str", "the instance from now on", required=False),
        F("why", "str", "what revealed it (class constructed)", required=False),
    )),
    Kind("proc.exit", "The process stopped recording (atexit or signal).", (
        F("events", "int", "events this process emitted"),
        F("dropped", "int", "events dropped because the queue was full"),
        F("hook_errors", "dict[str,int]", "hook name -> number of exceptions swallowed"),
        F("ring_discarded", "int", "record --ring only: events of this process deleted with segments older "
          "than the window", required=False),
    )),
    Kind("hooks.status", "Which hooks this process applied or skipped, with reasons.", (
        F("vllm", "str", "vLLM version seen by the process ('' if not importable)"),
        F("applied", "list[str]", "hook names patched in"),
        F("skipped", "dict[str,str]", "hook name -> reason (missing target, signature drift, import error)"),
        F("where", "dict[str,str]", "hook name -> the wrapped function's source, 'vllm/PATH.py:LINE QUALNAME' "
          "(where check's root causes point in vLLM)", required=False),
    )),
    Kind("hook.error", "A hook raised; the exception was swallowed and vLLM went on (first 5 per hook).", (
        F("hook", "str", "hook name"),
        F("error", "str", "exception type and message"),
    )),
    Kind("mark", "A free-form marker: scenario boundaries, fault-injection labels, notes.", (
        F("label", "str", "short label"),
        F("detail", "str", "longer text", required=False),
    )),
    Kind("fault.inject", "A test fixture re-introduced an old vLLM rule (fault injection). Never emitted in production.", (
        F("rule", "str", "which old rule: e.g. 'p-sends-full-allocation', 'clear-before-drafter'"),
        F("detail", "str", "what was patched and which upstream fix it undoes"),
    )),
    # --- scheduler ------------------------------------------------------------------------
    Kind("sched.config", "Scheduler constructed: static facts the detectors need.", (
        F("block_sizes", "list[int]", "block size of each KV cache group"),
        F("group_kinds", "list[str]", "spec class of each group: FullAttentionSpec, SlidingWindowSpec, MambaSpec, ..."),
        F("num_lookahead_tokens", "int", "scheduler.num_lookahead_tokens"),
        F("num_spec_tokens", "int", "speculative tokens per step (0 = no spec decode)"),
        F("spec_method", "str", "speculative method ('' if none): eagle, eagle3, mtp, dflash, ngram, draft_model"),
        F("kv_role", "str", "KVTransferConfig.kv_role ('' if no connector)"),
        F("connector", "str", "connector class on the scheduler ('' if none)"),
        F("async_scheduling", "bool", "scheduler_config.async_scheduling"),
        F("num_blocks", "int", "KV cache blocks in the pool"),
        F("sched", "int", "ordinal of this Scheduler object in its process (1, 2, ...): tells apart schedulers "
          "of one process, which may reuse request ids; nixl.request_finished / nixl.remote_alloc name it",
          required=False),
        F("engine", "str", "KVTransferConfig.engine_id (P's engine id is what D's remote_engine names)",
          required=False),
        F("windows", "list[int]", "per KV cache group: the sliding window (SlidingWindowSpec) or attention chunk "
          "(ChunkedLocalAttentionSpec) in tokens, 0 for others", required=False),
        F("transfer_group_ids", "list[int]", "the KV cache groups that take part in KV transfer, in the order "
          "the connector's per-group block lists follow (KVCacheConfig.transfer_group_ids; absent: every group)",
          required=False),
        F("draft_groups", "list[int]", "the KV cache groups vLLM marks as holding the drafter's (EAGLE / MTP) "
          "layers (KVCacheGroupSpec.is_eagle_group; KVCacheSpec.is_draft on 0.33); absent: none, or a release "
          "without the mark", required=False),
        F("draft_layers", "list[list[str]]", "per draft group (in draft_groups' order), its first layer names "
          "(at most 4)", required=False),
        F("exchange_blocks", "list[int]", "per transfer group, the in-window tail the NIXL connector keeps "
          "when it exchanges block lists (its own blocks_per_sw: 0 = the whole list), read from the connector",
          required=False),
        F("max_num_batched_tokens", "int", "scheduler_config.max_num_batched_tokens: the step's token budget",
          required=False),
        F("long_prefill_token_threshold", "int", "scheduler_config.long_prefill_token_threshold: the most tokens "
          "of a long prefill one step schedules (0 = no limit)", required=False),
    ), hook="scheduler"),
    Kind("sched.step", "One Scheduler.schedule() call returned.", (
        F("num_reqs", "int", "requests scheduled this step"),
        F("num_tokens", "int", "total tokens scheduled"),
        F("tokens", "dict[str,int]", "request id -> tokens scheduled"),
        F("spec", "dict[str,int]", "request id -> draft tokens scheduled for verification", required=False),
        F("finished", "list[str]", "requests finished since the previous step", required=False),
    ), hook="scheduler"),
    Kind("sched.output", "Scheduler.update_from_output processed one step's output (step: that step). Under async "
                         "scheduling a step is scheduled before the previous one's output is processed: its forward "
                         "writes KV until then (the KV model's in-flight writes, vLLM #37285). Not emitted for a step "
                         "that scheduled no token.", (), hook="kv_load"),
    Kind("req.add", "A request entered the scheduler.", (
        F("prompt_len", "int", "number of prompt tokens"),
        F("prompt_hash", "str", "blake2b-64 (16 hex digits) of CPython's hash of the prompt token ids as a tuple, as 8 little-endian bytes (redact.token_hash; redacted form)"),
        F("max_tokens", "int", "sampling max_tokens", required=False),
        F("kv", "dict", "kv_transfer_params summary: do_remote_prefill, do_remote_decode, remote_engine_id, remote_request_id, n_remote_blocks", required=False),
        F("prompt_ids", "list[int]", "prompt token ids, only with --no-redact", required=False),
    ), hook="scheduler"),
    Kind("req.finish", "A request left the scheduler (finished, aborted).", (
        F("status", "str", "RequestStatus name"),
        F("num_computed_tokens", "int", "request.num_computed_tokens at finish"),
        F("num_output_tokens", "int", "generated tokens"),
    ), hook="scheduler"),
    Kind("sched.alloc", "KVCacheManager.allocate_slots for one request (one event for all groups).", (
        F("ok", "bool", "False when allocation failed (no free blocks)"),
        F("block_ids", "list[list[int]]",
          "all block ids the request holds per group after the call. Absent on a running request's "
          "call that only appended new_block_ids (v2): the list is then the previous sched.alloc's "
          "block_ids (same pid, inst, req) + new_block_ids per group; pdtrace's loader fills it in "
          "and sets block_ids_derived", required=False),
        F("block_ids_derived", "bool", "set by the loader on an event whose block_ids it derived; never "
          "written to a file", required=False),
        F("new_block_ids", "list[list[int]]", "block ids newly allocated by this call, per group"),
        F("num_computed_tokens", "int", "request.num_computed_tokens before the step"),
        F("num_new_tokens", "int", "tokens scheduled this step"),
        F("num_lookahead_tokens", "int", "lookahead slots asked for (after the P/D 'effective lookahead' rule)"),
        F("sched_lookahead_tokens", "int", "scheduler.num_lookahead_tokens (before the rule); absent "
          "with block_ids", required=False),
        F("num_external_computed_tokens", "int", "tokens to load from a remote instance; absent (0) "
          "with block_ids", required=False),
        F("num_new_computed_tokens", "int", "local prefix-cache hit tokens; absent (0) with block_ids",
          required=False),
        F("delay_cache_blocks", "bool", "True while a remote KV load is pending; absent (false) with "
          "block_ids", required=False),
        F("prompt_len", "int", "request.num_prompt_tokens; absent with block_ids", required=False),
        F("from_output", "bool", "true: a running request's call, recorded from the step's "
          "SchedulerOutput.scheduled_cached_reqs (new_block_ids, num_computed_tokens) rather than "
          "from the call itself; t is the start of that schedule() call, step is its sched.step",
          required=False),
    ), hook="scheduler"),
    Kind("sched.free", "The scheduler freed a request's blocks.", (
        F("block_ids", "list[list[int]]", "block ids held per group just before the free"),
    ), hook="scheduler"),
    # --- NIXL connector: scheduler side ---------------------------------------------------
    Kind("nixl.request_finished", "Connector request_finished on a finished request (P side: what it reports to D).", (
        F("side", "str", "P when do_remote_decode (producer) else D"),
        F("allocated_block_ids", "list[list[int]]", "all blocks the request holds on this instance, per group"),
        F("arg_block_ids", "list[list[int]]", "block ids the scheduler passed to request_finished, per group"),
        F("block_ids", "list[list[int]]", "remote_block_ids reported in kv_transfer_params, per group"),
        F("remote_num_tokens", "int", "remote_num_tokens reported; absent when the params carried none "
          "(unknown, not 0)", required=False),
        F("num_computed_tokens", "int", "request.num_computed_tokens"),
        F("prompt_len", "int", "request.num_prompt_tokens"),
        F("delay_free", "bool", "blocks held for the remote read"),
        F("allocated_from", "str", "where allocated_block_ids came from: kv_cache_manager | connector (the scheduler's arg)", required=False),
        F("sched", "int", "the emitting scheduler (sched.config's sched, same pid)", required=False),
        F("engine", "str", "this instance's engine id (D's nixl.remote_alloc names it as remote_engine)", required=False),
    ), hook="nixl"),
    Kind("nixl.remote_alloc", "D side: update_state_after_alloc for a request whose KV comes from P.", (
        F("local_block_ids", "list[list[int]]", "blocks D allocated, per group"),
        F("remote_block_ids", "list[list[int]]", "remote_block_ids from P's kv_transfer_params, per group"),
        F("remote_num_tokens", "int", "remote_num_tokens from P", required=False),
        F("num_external_tokens", "int", "tokens D will load"),
        F("load_block_ids", "list[list[int]]", "the blocks D's connector will load into, per transfer group, as the "
          "connector itself derived them (unhashed, no null blocks, sliding-window tail): what it hands its "
          "worker's trim", required=False),
        F("remote_req", "str", "P's request id (remote_request_id)", required=False),
        F("remote_engine", "str", "P's engine id", required=False),
        F("sched", "int", "the emitting scheduler (sched.config's sched, same pid)", required=False),
        F("engine", "str", "D's own engine id", required=False),
    ), hook="nixl"),
    Kind("nixl.trim", "_apply_prefix_caching (or _apply_prefix_caching_by_region) decided which decode (D) "
         "and prefill (P) blocks pair up: on D in pull mode, on P in push mode.", (
        F("local_in", "list[list[int]]", "decode (D) block ids in"),
        F("remote_in", "list[list[int]]", "prefill (P) block ids in"),
        F("local_out", "list[list[int]]", "decode block ids out"),
        F("remote_out", "list[list[int]]", "prefill block ids out: local_out[g][i] <- remote_out[g][i]"),
        F("mamba", "bool", "the worker has Mamba/state groups (trim skipped for them)", required=False),
        F("mode", "str", "'push' when P ran it inside NixlPushConnectorWorker._xfer_blocks (absent: pull, on D)",
          required=False),
        F("remote_req", "str", "push mode: D's request id (req is P's)", required=False),
        F("by_region", "bool", "true: the region-layout trim (per KV region, not per group)", required=False),
        F("inline", "bool", "true: vLLM 0.20-0.21, whose _read_blocks trims inline: the out lists are the ones "
          "it handed _get_block_descs_ids", required=False),
        F("raised", "str", "the trim raised ('Type: message'; the out lists are then empty): e.g. D holds more "
          "blocks to load than P reported (vLLM #50558)", required=False),
    ), hook="nixl"),
    Kind("nixl.read", "D side: a NIXL read was issued.", (
        F("local_block_ids", "list[list[int]]", "destination (local) blocks"),
        F("remote_block_ids", "list[list[int]]", "source (remote) blocks, pairwise with local_block_ids"),
        F("bytes", "int", "bytes requested (0 if unknown)"),
        F("handle", "str", "transfer handle (repr)"),
        F("remote_engine", "str", "P's engine id", required=False),
        F("remote_req", "str", "P's request id", required=False),
    ), hook="nixl"),
    Kind("nixl.read_done", "D side: a NIXL read completed or failed.", (
        F("status", "str", "DONE | ERR | TIMEOUT"),
        F("handle", "str", "transfer handle (repr)", required=False),
        F("dur_ns", "int", "time from issue to completion", required=False),
    ), hook="nixl"),
    Kind("nixl.send_done", "P side: D's read of this request finished (blocks can be freed); push mode: P's "
         "WRITE into D's blocks completed.", (
             F("mode", "str", "'push': recorded by push mode's get_transfer_results (absent: pull, or a lease's end)",
               required=False),
         ), hook="nixl"),
    Kind("nixl.lease_expired", "P side: the NIXL worker released the request's blocks because no decode worker "
         "read them before its KV lease ran out (_reap_expired_send_leases, vLLM 0.32+); the scheduler frees "
         "them for other requests.", (
             F("retrieved", "int", "read-completion notifications P had counted for it (of those it waits for)"),
             F("engine", "str", "P's engine id (D's nixl.remote_alloc names it as remote_engine)", required=False),
         ), hook="nixl"),
    Kind("kv.digest_setup", "record --kv-checksum: the transfer layers a worker's KV digests read (the NIXL "
         "connector's registered KV tensors, one order on both sides).", (
             F("layers", "int", "layers read per digest"),
             F("groups", "list[int]", "their transfer groups"),
             F("skipped", "list[str]", "layers not read, per reason (a KV cache not on the CPU, a state group)"),
             F("every", "int", "record --kv-checksum-every N: one request in N digested (1: every request)",
               required=False),
             F("layout", "str", "what must match on P and D for digests to compare: layers, dtype, a block's "
               "shape, TP size", required=False),
         ), hook="nixl"),
    Kind("kv.digest", "record --kv-checksum: Adler-32 of blocks' bytes over the transfer layers of their group. "
         "side P: a request held for a remote decode, when the scheduler reports it finished (its KV is final); "
         "side D: a request's blocks for its computed tokens, before its first forward reads them.", (
             F("side", "str", "P | D"),
             F("blocks", "dict", "group (str) -> {block id (str): digest}"),
             F("ns", "int", "time this digest took on the traced thread (ns)", required=False),
         ), hook="nixl"),
    # --- connector metadata lifecycle in the model runner ----------------------------------
    Kind("kvmeta.bind", "bind_connector_metadata on the worker-side connector.", (
        F("connector", "str", "connector class"),
        F("n_recv", "int", "requests to receive"),
        F("n_save", "int", "requests to save"),
        F("n_send", "int", "requests to send"),
        F("reqs", "list[str]", "request ids named in the metadata", required=False),
    ), hook="connector_metadata"),
    Kind("kvmeta.clear", "clear_connector_metadata.", (
        F("phase", "str", "phase at the time: target | drafter | '' (between)"),
    ), hook="connector_metadata"),
    Kind("kvmeta.has", "has_connector_metadata() answered (the per-layer save/load decorators ask it).", (
        F("result", "bool", "what it returned"),
        F("phase", "str", "target | drafter | ''"),
    ), hook="connector_metadata"),
    Kind("kvmeta.save_layer", "save_kv_layer for one attention layer.", (
        F("layer", "str", "layer name"),
        F("phase", "str", "target | drafter"),
    ), hook="connector_metadata"),
    Kind("kvmeta.wait_for_save", "wait_for_save.", (
        F("phase", "str", "target | drafter | ''"),
    ), hook="connector_metadata"),
    Kind("spec.phase", "A model phase began or ended in the runner (target forward, drafter propose).", (
        F("phase", "str", "target | drafter"),
        F("edge", "str", "begin | end"),
        F("method", "str", "drafter method for the drafter phase", required=False),
        F("layers", "list[str]", "attention layer names of this phase's model", required=False),
        F("runner", "str", "'v2' when model runner V2's hooks (spec_v2) emitted it", required=False),
    ), hook="connector_metadata"),
    Kind("spec.window", "The drafter's KV write window for one request in this step (V2: from spec_v2).", (
        F("start", "int", "first token position the drafter writes KV for"),
        F("end", "int", "one past the last position written"),
        F("method", "str", "drafter method"),
        F("group", "int", "KV cache group", required=False),
    ), hook="accepted_counts"),
    # --- accepted-token counts (async spec decode) ------------------------------------------
    Kind("d2h.issue", "Non-blocking D2H copy of num_accepted_tokens issued, then event.record().", (
        F("buf", "str", "destination buffer name"),
        F("rows", "list[str]", "request id held by each row at issue time ('' = empty row)"),
        F("event", "str", "id of the CUDA event recorded after the copy"),
        F("blocking", "bool", "the copy was complete when the call returned (source tensor on CPU)",
          required=False),
        F("moves_with_rows", "bool", "the destination is InputBatch's per-row buffer, which add_request, "
          "swap_states and condense rewrite (false: a runner-owned snapshot, as in vLLM PR #51599)",
          required=False),
        F("values", "list[int]", "blocking copy: the counts it wrote, per row", required=False),
    ), hook="accepted_counts"),
    Kind("d2h.done", "The copy's event was observed complete (event.query() is True, no sync).", (
        F("event", "str", "event id"),
        F("values", "list[int]", "the copy's own counts per row of d2h.issue's rows, read from the host "
          "buffer when no row changed since the issue (a request's own count; in Mamba align mode 1 after "
          "a block-boundary state copy)", required=False),
    ), hook="accepted_counts"),
    Kind("acc.read", "The CPU read num_accepted_tokens for a request row in _prepare_inputs.", (
        F("row", "int", "InputBatch row read"),
        F("value", "int", "value read"),
        F("event", "str", "event id of the last copy into the buffer", required=False),
        F("event_done", "bool", "event.query() at read time (None if no event)", required=False),
        F("synced", "bool", "the runner called event.synchronize() before reading", required=False),
        F("mapping", "str", "prev: read through the previous step's row (prev_positions, async scheduling); "
          "direct: the request's current row", required=False),
    ), hook="accepted_counts"),
    Kind("acc.device", "Model runner V2 keeps the accepted counts on the device, one entry per request slot "
                       "(no CPU copy for a step to read stale): the stale-read class does not apply to this worker.", (
        F("holder", "str", "the model-state class holding them, module-qualified"),
        F("attr", "str", "the attribute (num_accepted_tokens_gpu)"),
        F("device", "str", "its device"),
        F("keyed_by", "str", "'slot': indexed by RequestState slot, gathered per step on the device"),
        F("cpu_copy", "bool", "the holder also has an accepted-count buffer on the host"),
        F("copies", "list[str]", "those host buffers' attribute names", required=False),
        F("runner", "str", "'v2'", required=False),
    ), hook="states_v2"),
    Kind("acc.truth", "The GPU-authoritative accepted count for a request, obtained without a sync.", (
        F("value", "int", "authoritative value"),
        F("for_step", "int", "step whose verification produced it"),
    ), hook="accepted_counts"),
    # --- input batch ----------------------------------------------------------------------
    Kind("batch.add", "InputBatch.add_request put a request in a row (V2: RequestState.add_request gave it a slot).", (
        F("row", "int", "row index (V2: the RequestState slot, the block-table row)"),
        F("runner", "str", "'v2' when emitted by states_v2", required=False),
        F("copy", "str", "event id of an accepted-count copy still in flight at this move", required=False),
        F("landed", "str", "where that copy landed relative to this move, from event.query() just before and "
          "after it (never a sync): after | unknown (before: d2h.done precedes the move)", required=False),
    ), hook="input_batch"),
    Kind("batch.remove", "InputBatch.remove_request emptied a row (V2: RequestState.remove_request freed a slot).", (
        F("row", "int", "row index (-1 if not present)"),
        F("runner", "str", "'v2' when emitted by states_v2", required=False),
    ), hook="input_batch"),
    Kind("batch.swap", "InputBatch.swap_states(i1, i2).", (
        F("i1", "int", "first row"),
        F("i2", "int", "second row"),
        F("req1", "str", "request in i1 before the swap"),
        F("req2", "str", "request in i2 before the swap"),
        F("copy", "str", "event id of an accepted-count copy still in flight at this move", required=False),
        F("landed", "str", "where that copy landed relative to this move, from event.query() just before and "
          "after it (never a sync): after | unknown (before: d2h.done precedes the move)", required=False),
    ), hook="input_batch"),
    Kind("batch.condense", "InputBatch.condense() moved requests into empty rows.", (
        F("moves", "list[list]", "[request id, old row, new row] for each moved request"),
        F("copy", "str", "event id of an accepted-count copy still in flight at this move", required=False),
        F("landed", "str", "where that copy landed relative to this move, from event.query() just before and "
          "after it (never a sync): after | unknown (before: d2h.done precedes the move)", required=False),
    ), hook="input_batch"),
    # --- model runner ------------------------------------------------------------------------
    Kind("runner", "A worker built its model runner (vLLM's V1 runner or model runner V2, the GPU default). "
                   "Each runner has its own worker hooks (V1: connector_metadata, accepted_counts, input_batch; "
                   "V2: spec_v2, states_v2); `check` reads this event to tell which worker's events could exist "
                   "and which V2 workers must have recorded acc.device.", (
        F("runner", "str", "'v1' (vllm/v1/worker/gpu_model_runner.py; vLLM's CPU runner too) or 'v2' "
                           "(vllm/v1/worker/gpu/model_runner.py)"),
        F("cls", "str", "the runner's class, module-qualified"),
    ), hook="runner"),
    # --- KV that failed to load, and the recovery (issue 36) ----------------------------------
    Kind("kvload.error", "D's NIXL worker logged a failed KV transfer (_log_failure): a handshake, a transfer "
                         "or its setup, a notification. req: the local request, when there is one.", (
        F("failure", "str", "vLLM's failure_type: handshake_failed, transfer_failed, transfer_setup_failed, "
                            "transfer_exception, notification_failed, ..."),
        F("engine", "str", "this worker's engine id"),
        F("error", "str", "the exception, 'Type: message' (cut at 300 characters)", required=False),
        F("detail", "str", "vLLM's message for it", required=False),
        F("remote_req", "str", "the remote (P's) request id, when the transfer was known", required=False),
        F("remote_engine", "str", "the remote engine id, when known", required=False),
    ), hook="kv_load"),
    Kind("kvload.reported", "D's worker handed the scheduler the blocks whose load failed "
                            "(get_block_ids_with_load_errors; KVConnectorOutput.invalid_block_ids).", (
        F("block_ids", "list[int]", "local block ids (KV cache group 0: vLLM reports one group)"),
    ), hook="kv_load"),
    Kind("kvload.handled", "The scheduler handled a KV load failure reported by the worker: "
                           "_handle_failed_recving (whole requests) or _handle_invalid_blocks (blocks).", (
        F("source", "str", "'failed_recving' or 'invalid_blocks'"),
        F("policy", "str", "kv_load_failure_policy: 'fail' (the default) or 'recompute'"),
        F("groups", "int", "KV cache groups of the scheduler"),
        F("failed", "list[str]", "requests the scheduler fails for it (policy 'fail')"),
        F("rescheduled", "list[str]", "policy 'recompute', invalid_blocks: the running requests cut back and "
                                      "rescheduled (their output this step is dropped)", required=False),
        F("block_ids", "list[int]", "invalid_blocks: the block ids reported", required=False),
        F("reqs", "list[str]", "failed_recving: the requests reported", required=False),
        F("error", "str", "the handler raised (vLLM refuses block-level failures on multi-group models)",
          required=False),
    ), hook="kv_load"),
    Kind("kvload.request", "One request a handled KV load failure changed (or failed, or queued for a retry), "
                           "read before and after the scheduler's decision.", (
        F("source", "str", "'failed_recving' or 'invalid_blocks'"),
        F("policy", "str", "'fail' or 'recompute'"),
        F("status", "str", "the request's status before: WAITING_FOR_REMOTE_KVS (an async load) or RUNNING"),
        F("computed_before", "int", "num_computed_tokens before"),
        F("computed", "int", "num_computed_tokens after: where the recompute restarts"),
        F("placeholders_before", "int", "num_output_placeholders before (async scheduling)"),
        F("placeholders", "int", "num_output_placeholders after"),
        F("num_tokens", "int", "the request's tokens (prompt + output so far)"),
        F("block_ids", "list[list[int]]", "the request's blocks per KV cache group at the decision"),
        F("action", "str", "'fail' (the request is failed), 'recompute' (computed tokens cut back), 'none' "
                           "(kept: e.g. its failed blocks are recomputed by another request)"),
        F("retry", "bool", "queued in failed_recving_kv_req_ids: retried once its load completes"),
    ), hook="kv_load"),
    Kind("kvload.output", "After a rollback (kvload.request action 'recompute'): what update_from_output appended "
                          "to the request from one step's output. step: the step whose output it was (null when "
                          "pdtrace no longer knew it). Followed until the output of a step scheduled after the "
                          "rollback, or the request's end.", (
        F("rollback_step", "int", "the step (kvload.handled) of the rollback: the latest step scheduled then"),
        F("position", "int", "the request's output tokens before this output (where its tokens went)"),
        F("appended", "int", "output tokens appended from this output (0: vLLM dropped it)"),
        F("computed", "int", "num_computed_tokens after it"),
        F("in_flight", "bool", "the step was scheduled before the rollback: it ran on the KV that failed to load"),
    ), hook="kv_load"),
)

# Kinds that always concern one request: ``req`` is required (a string) for them, so an event
# whose request is missing or null is refused by the loader and named, instead of dropping out
# of the per-request joins silently (issue 20).
PER_REQUEST = frozenset({
    "sched.alloc", "sched.free", "req.add", "req.finish", "acc.read", "acc.truth", "spec.window",
    "batch.add", "batch.remove", "nixl.request_finished", "nixl.remote_alloc", "nixl.read",
    "nixl.read_done", "nixl.send_done", "nixl.lease_expired", "kvload.request", "kvload.output", "kv.digest"})
_KINDS = tuple(dataclasses.replace(k, fields=(F("req", "str", "the request (required for this kind)"),) + k.fields)
               if k.name in PER_REQUEST else k for k in _KINDS)
KINDS: dict[str, Kind] = {k.name: k for k in _KINDS}
COMMON_NAMES = frozenset(f.name for f in COMMON)
REQUIRED_COMMON = frozenset(f.name for f in COMMON if f.required)

HEADER_FIELDS: tuple[Field, ...] = (
    F("ev", "str", "'trace.header'"),
    F("schema", "str", "'pdtrace'"),
    F("schema_version", "int", "format version; a reader refuses a higher major version"),
    F("pdtrace", "str", "pdtrace version that wrote it"),
    F("versions", "dict[str,str]", "vllm, torch, nixl, python versions ('' if absent)"),
    F("cmd", "list[str]", "recorded command line, secrets masked"),
    F("host", "str", "host name"),
    F("created", "str", "ISO-8601 UTC time the trace was written"),
    F("redacted", "bool", "prompt text / token ids left out"),
    F("origin", "str", "how it was produced: 'record' (live), 'scenario' (real vLLM scheduler on CPU + simulated worker side), 'merge', 'synthetic' (generated for benchmarks)"),
    F("instances", "list[str]", "instances present (P, D, ...)", required=False),
    F("clock", "dict", "merge only: per-instance offset_ns applied and residual skew", required=False),
    F("merged_from", "list[dict]", "merge only: each input trace's file name, origin, host and recorded "
      "command (cmd above is the first input's), and its ring_s / snapshot when it has them", required=False),
    F("source_origins", "list[str]", "merge only: the inputs' origins", required=False),
    F("ring_s", "float", "record --ring only: the flight recorder's window in seconds; events older than the "
      "window were discarded (footer ring_discarded), process-level events are all kept. A merge of "
      "flight-recorder traces keeps the widest of their windows (each input's is in merged_from)",
      required=False),
    F("snapshot", "str", "record --ring only: why this trace was written while the command ran "
      "('SIGUSR1', or 'online check: RULE in pid N at step S: REASON' when a worker's online check "
      "asked for it, pdtrace.record.online); absent for the trace written at exit", required=False),
)

FOOTER_FIELDS: tuple[Field, ...] = (
    F("ev", "str", "'trace.footer'"),
    F("events", "int", "number of event lines"),
    F("counts", "dict[str,int]", "events per kind"),
    F("dropped", "int", "events dropped by full queues, all processes"),
    F("hook_errors", "dict[str,int]", "hook -> exceptions swallowed, all processes"),
    F("hooks", "dict", "{'applied': [...], 'skipped': {hook: reason}} over all processes"),
    F("processes", "list[dict]", "pid, role, inst, events, dropped, complete (False: shard ended without proc.exit)"),
    F("exit_code", "int", "exit code of the recorded command", required=False),
    F("lost", "int", "events in shard frames that could not be read back (damaged by a crash or a "
      "failed write; counted from the frame header where it survived)", required=False),
    F("shard_problems", "list[str]", "record only: each damaged shard stretch skipped, with its file, "
      "frame, bytes skipped and events lost", required=False),    F("ring_discarded", "int", "record --ring only: events discarded by the flight recorder's window, all "
      "processes (the counts and processes above are of the events kept)", required=False),
    F("digest", "str", "'crc32:' and 8 hex digits: the CRC-32 of the event lines (every byte after the header "
      "line and before the footer line). Written only when the writer type-checked every event against this "
      "schema; a reader that finds it matching skips its own type checks, any other trace is checked event by "
      "event", required=False),
)


# --- field types ----------------------------------------------------------------------
# Each Field's ``type`` string is also what the loader checks (``type_error``): int, str and
# bool are exact (``true`` is not an int), list[...] / dict[...] check their elements. A
# field that is not required may also be null. ``type_error`` names the first bad field.

_SCALARS = {"int": int, "str": str, "bool": bool}


def _check_for(t: str) -> Any:
    """A predicate for values of type ``t``. Lists and dicts of exact scalars compare the set of
    their elements' types (one C-level pass, no Python call per element): the loader's fast path
    runs these on every event with nested fields."""
    t = t.replace(" ", "")
    if t in _SCALARS:
        want = _SCALARS[t]
        return lambda v, want=want: type(v) is want
    if t == "float":
        return lambda v: type(v) is float or type(v) is int
    if t == "dict":
        return lambda v: type(v) is dict
    if t == "list":
        return lambda v: type(v) is list
    if t.startswith("list[") and t.endswith("]"):
        inner_t = t[5:-1]
        if inner_t in _SCALARS:
            only = frozenset([_SCALARS[inner_t]])
            return lambda v, only=only: type(v) is list and set(map(type, v)) <= only
        if inner_t == "list":
            return lambda v: type(v) is list and set(map(type, v)) <= _LIST
        if inner_t.startswith("list[") and inner_t[5:-1] in _SCALARS:
            only = frozenset([_SCALARS[inner_t[5:-1]]])
            return lambda v, only=only: (type(v) is list and set(map(type, v)) <= _LIST
                                         and set(map(type, _chain(v))) <= only)
        inner = _check_for(inner_t)
        return lambda v: type(v) is list and all(map(inner, v))
    if t.startswith("dict[") and t.endswith("]"):
        kt, vt = t[5:-1].split(",", 1)
        if kt in _SCALARS and vt in _SCALARS:
            konly, vonly = frozenset([_SCALARS[kt]]), frozenset([_SCALARS[vt]])
            return lambda v, k=konly, w=vonly: (type(v) is dict and set(map(type, v)) <= k
                                                and set(map(type, v.values())) <= w)
        kc, vc = _check_for(kt), _check_for(vt)
        return lambda v: type(v) is dict and all(map(kc, v)) and all(map(vc, v.values()))
    return lambda v: True  # a documentation-only type: anything goes


_LIST = frozenset([list])
_chain = chain.from_iterable


def nested_type(t: str) -> bool:
    """Whether a value of declared type ``t`` has elements to check beyond its own type."""
    t = t.replace(" ", "")
    return (t.startswith("list[") or t.startswith("dict[")) and t.endswith("]")


def _field_checks(fields: tuple[Field, ...]) -> dict[str, tuple[Any, str, bool]]:
    return {f.name: (_check_for(f.type), f.type, f.required) for f in fields}


_COMMON_CHECKS = _field_checks(COMMON)
# an event may lack "id" (the loader numbers it), but a null one is no ordinal: a bad line, not a
# missing field (the third item is "null is not allowed", which type_error reads as for a required field)
_COMMON_CHECKS["id"] = (_COMMON_CHECKS["id"][0], "int", True)
FIELD_CHECKS: dict[str, dict[str, tuple[Any, str, bool]]] = {
    name: {**_COMMON_CHECKS, **_field_checks(k.fields)} for name, k in KINDS.items()}
HEADER_CHECKS = _field_checks(HEADER_FIELDS)
FOOTER_CHECKS = _field_checks(FOOTER_FIELDS)
_PROC_CHECKS = {"pid": _check_for("int"), "role": _check_for("str"), "inst": _check_for("str"),
                "events": _check_for("int"), "dropped": _check_for("int"), "complete": _check_for("bool")}
FOOTER_CHECKS["hooks"] = (lambda v: type(v) is dict and _check_for("list[str]")(v.get("applied", []))
                          and _check_for("dict[str,str]")(v.get("skipped", {})),
                          "{'applied': list[str], 'skipped': dict[str,str]}", True)
FOOTER_CHECKS["processes"] = (lambda v: type(v) is list and all(
    type(p) is dict and all(c(p[k]) for k, c in _PROC_CHECKS.items() if k in p) for p in v),
    "list of {pid: int, role: str, inst: str, events: int, dropped: int, complete: bool}", True)


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", str: "string", list: "list", dict: "object",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def type_error(obj: dict[str, Any], checks: dict[str, tuple[Any, str, bool]], what: str) -> str | None:
    """The first field of ``obj`` whose value does not have its declared type, as a reason
    naming it ("sched.alloc: field 'ok' should be bool, got string"), or None."""
    for name, value in obj.items():
        c = checks.get(name)
        if c is None:
            continue  # a field this version does not know: ignored
        check, t, required = c
        if value is None and not required:
            continue
        if not check(value):
            return f"{what}: field {name!r} should be {t}, got {_type_name(value)}"
    return None


def new_kind_error(kind: str) -> str:
    return f"unknown event kind {kind!r} (not in schema v{SCHEMA_VERSION})"


def validate_event(ev: dict[str, Any]) -> str | None:
    """Return None if ``ev`` is a valid event of a known kind, else a reason."""
    kind = ev.get("ev")
    if not isinstance(kind, str):
        return "missing 'ev' (event kind)"
    spec = KINDS.get(kind)
    if spec is None:
        return new_kind_error(kind)
    missing = (REQUIRED_COMMON | spec.required) - ev.keys()
    if missing:
        return f"{kind}: missing field(s) {', '.join(sorted(missing))}"
    return None


def render_markdown() -> str:
    """The body of docs/trace-format.md, generated from this module."""
    out: list[str] = []
    out.append(f"# pdtrace trace format (schema version {SCHEMA_VERSION})\n")
    out.append("<!-- generated by `python -m pdtrace.schema > docs/trace-format.md`; "
               "tests/test_schema.py fails when this file and pdtrace/schema.py disagree -->\n")
    out.append((__doc__ or "").strip() + "\n")
    out.append("## Header (line 1)\n")
    out.extend(_table(HEADER_FIELDS))
    out.append("## Common fields (every event)\n")
    out.extend(_table(COMMON))
    out.append("## Event kinds\n")
    for k in _KINDS:
        who = f" Emitted by `pdtrace.hooks.{k.hook}`." if k.hook else ""
        out.append(f"### `{k.name}`\n\n{k.doc}{who}\n")
        if k.fields:
            out.extend(_table(k.fields))
        else:
            out.append("No fields beyond the common ones.\n")
    out.append("## Footer (last line)\n")
    out.extend(_table(FOOTER_FIELDS))
    out.append(
        "## Compatibility\n\n"
        f"A reader of schema version {SCHEMA_VERSION} refuses a trace whose header has a higher "
        "`schema_version` (error names line 1) unless `--lenient`, in which case it reads the "
        "known kinds and counts the rest. Unknown kinds in a trace of the same version are an "
        "error naming the line (a warning with `--lenient`). Fields may be added within a "
        "version; readers ignore fields they do not know.\n\n"
        "Version history: 1, first format. 2, `sched.alloc` on a running request's call that "
        "only appended blocks carries `new_block_ids` without `block_ids` and the fields that "
        "only matter on a first allocation (the full list is derived from the previous "
        "`sched.alloc`); readers of version 2 read version 1 traces unchanged. Within version 2, "
        "pdtrace 0.1 recorders write those short events of RUNNING requests from the step's "
        "SchedulerOutput, marked `from_output` (an added field; same meaning).\n"
    )
    return "\n".join(out)


def _table(fields: tuple[Field, ...]) -> list[str]:
    rows = ["| field | type | required | meaning |", "| --- | --- | --- | --- |"]
    for f in fields:
        rows.append(f"| `{f.name}` | {f.type} | {'yes' if f.required else 'no'} | {f.doc} |")
    rows.append("")
    return ["\n".join(rows)]


if __name__ == "__main__":  # pragma: no cover
    print(render_markdown())
