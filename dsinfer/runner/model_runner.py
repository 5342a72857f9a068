"""ModelRunner: StepPlan -> ForwardBatch -> logits -> sampled tokens (+ logprobs), the worker's side of a step.

It owns the model, the KV cache tensors (sized from the memory budget after the model loads), the table of
per-request state it keeps from the plans (``request_table``) and, on CUDA, the CUDA graphs: whole-step graphs
for decode (``cuda_graphs``, per batch size and tokens per request), piecewise ones for steps with prompt tokens
(``prefill_graphs``). ``launch`` queues a step and returns a ``StepHandle`` without waiting for the GPU;
``execute`` is ``launch(...).result()``.

MTP drafting (``speculative_config.method="mtp"``): the model's MTP layer keeps its own latent cache, one more
layer of the KV spec paged by the same block ids; once a step's tokens are on the host, ``result()`` runs it on
the step's hidden states (``mtp_proposer``) and the RunnerOutput carries each sampling request's next drafts.
Its steps run eagerly (the MTP layer reads the target's hidden states, which the CUDA graphs do not return).

Decode graphs are captured for every query length 1..1 + k a sequence. A step whose sequences have different
query lengths (confidence scheduling verifies different draft counts) is padded to its longest
(``decode_padding``: padding tokens store nothing and their logits are not read) and replays that length's graph,
for models without per-sequence state and with one KV cache group; ``decode_padding`` (the property) tells the
engine which steps run so, as its scheduler prices them by that length.

Draft tokens: every position of a request samples with the sampling rules of its own place (penalties and bans
see the drafts before it; noise keyed by its own position), and a draft is kept while it equals the token
sampled before it. With ``acceptance="exact"`` (and for greedy requests in either mode) that token is the one a
one-token step would have sampled, so the tokens a request gets are the ones one-token steps would have given
it; with ``"rejection"`` a sampled position keeps its draft by rejection sampling (``Sampler``): the same
distribution, not the same tokens. With a one-hot draft (n-gram) both keep draft d with probability p(d).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import numpy as np
import torch

from dsinfer import envs
from dsinfer.batch_invariant import batch_invariant
from dsinfer.config import EngineConfig
from dsinfer.core import step_latency
from dsinfer.core.kv_cache_spec import (
    KVCacheSpec,
    StateSlotSpec,
    bytes_per_block,
    kv_cache_groups,
    max_blocks_held,
    shares_tensors,
)
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.plan import StepPlan
from dsinfer.distributed.state import SINGLE, ParallelState
from dsinfer.kvstore.keys import engine_fingerprint
from dsinfer.models.loader.model_loader import load_model
from dsinfer.runner import boundary_states
from dsinfer.runner.cuda_graphs import DecodeGraphs, graph_modes
from dsinfer.runner.decode_padding import PaddedStep, pad_step
from dsinfer.runner.input_batch import SampleRow, StepInputs, build_sampling_batch, build_step_inputs, to_device_packed
from dsinfer.runner.kv_transfer import KVTransfer
from dsinfer.runner.memory import GiB, check_weights_fit, kv_budget_bytes
from dsinfer.runner.mtp_proposer import MTPProposer
from dsinfer.runner.prefill_graphs import PrefillGraphs
from dsinfer.runner.request_table import RequestTable
from dsinfer.runner.step_handle import StepHandle, score_tokens, to_host
from dsinfer.runner.warmup import measure_step_latency, warm_up_prefill
from dsinfer.sampling.sampler import Sampler

logger = logging.getLogger("dsinfer")

class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState = SINGLE):
        """``parallel``: this rank's tensor-parallel state (its worker joined the group): the model holds this
        rank's slice of the weights and its heads' KV cache; every rank runs every step."""
        self.config = config
        self.parallel = parallel
        self.device = config.device.device
        if self.device.type == "cpu" and envs.CPU_THREADS.get():
            torch.set_num_threads(envs.CPU_THREADS.get())
        if self.device.type == "cuda":
            check_weights_fit(config, parallel)
        self.model = load_model(config, parallel)
        self.eplb = None  # the expert load counters and rebalances (before any capture: the graphs count too)
        if config.parallel.enable_eplb:
            from dsinfer.distributed.eplb.balancer import ExpertLoadBalancer

            self.eplb = ExpertLoadBalancer(self.model.moe_blocks(), config.parallel.eplb_config,
                                           int(config.model.hf_config.get("n_group") or 1), self.device, parallel)
        moe = self.model.moe_blocks() if hasattr(self.model, "moe_blocks") else []
        # routed-expert storage slots per MoE layer on this rank (its share under expert parallelism)
        self.num_local_expert_slots = moe[0].experts.num_storage if moe else 0
        self.vocab_size = config.model.vocab_size
        self.block_size = config.cache.block_size
        layers = self.model.attention_layers()
        self.mtp: MTPProposer | None = None
        spec = config.speculative
        if spec.enabled and spec.method == "mtp":
            mtp = getattr(self.model, "mtp", None)
            if mtp is None:
                raise ValueError("speculative_config.method='mtp': the checkpoint has no MTP layer weights to draft "
                                 "with; use method='ngram'")
            layers = layers + mtp.attention_layers()[:1]  # the first MTP layer drafts (``mtp_proposer``)
            self.mtp = MTPProposer(mtp, spec.num_speculative_tokens, config.cache.block_size, self.device)
        cache_dtype = config.cache.cache_dtype or config.model.dtype
        # a layer may page nothing (None: DeepSeek-V4's sliding layers) and keep per-sequence state (``state_spec``)
        specs = [layer.kv_cache_spec(self.block_size, cache_dtype) for layer in layers]
        paged_specs = [spec for spec in specs if spec is not None]
        # with prefix caching or the KV store, each block also keeps the state slots' rows at its end (paged by
        # the same block ids, counted in the block's bytes), so a hit at a block end restores the slot exactly;
        # the model's layers only: an MTP layer's rings (written after the step, past it by chained drafts) start
        # a hit stale, which costs some of its drafts' acceptance for a window, never a token
        keeps_boundaries = config.cache.enable_prefix_caching or config.kv_store.enabled
        self.boundary_layers = [layer for layer in self.model.attention_layers() if hasattr(layer, "boundary_spec")
                                ] if keeps_boundaries else []
        boundary_specs = [layer.boundary_spec(self.block_size, cache_dtype) for layer in self.boundary_layers]
        self.kv_specs: list[KVCacheSpec] = paged_specs + boundary_specs
        # one block table per layout (GPT-OSS: full and sliding layers); one group for most models
        self.kv_groups = kv_cache_groups(self.kv_specs)
        self.kv_group_windows = tuple(group.sliding_window for group in self.kv_groups)
        max_drafts = config.speculative.num_speculative_tokens
        self.state_specs: list[StateSlotSpec] = [layer.state_spec(max_drafts, cache_dtype) for layer in layers
                                                 if hasattr(layer, "state_spec")]
        # every running request holds one slot: as many as the scheduler runs at once
        self.num_state_slots = config.scheduler.max_num_seqs if self.state_specs else 0
        # every rank sizes its own cache from its own memory; all must page the same blocks
        self.num_blocks = parallel.min_over_ranks(self._num_kv_blocks(), self.device)
        for layer in layers:
            layer.kv_cache = None
            if hasattr(layer, "state_spec"):
                layer.state = layer.state_spec(max_drafts, cache_dtype).allocate(self.num_state_slots, self.device)
        paged = [layer for layer, spec in zip(layers, specs) if spec is not None]
        self._allocate_kv_caches(paged, paged_specs)
        for layer, spec in zip(self.boundary_layers, boundary_specs):
            layer.boundary = spec.allocate(self.num_blocks, self.device)
        self.max_draft_tokens = max_drafts
        self.kv_transfer: KVTransfer | None = None
        if config.kv_store.enabled:
            caches = [layer.kv_cache for layer in paged] + [layer.boundary for layer in self.boundary_layers]
            self.kv_transfer = KVTransfer(caches, self.kv_specs, config, engine_fingerprint(config))
        self.sampler = Sampler()
        self.requests = RequestTable()
        # the last launched step's sampled tokens (device) and each request's row in them: async scheduling
        # fills the next step's placeholder input ids from here, on the device
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] | None = None  # benchmarks
        self.graphs: DecodeGraphs | None = None
        # tests: pad steps of different query lengths (``decode_padding``) even where no graph replays them (the
        # eager model runs the padded batch)
        self.force_decode_padding = False
        self.prefill_graphs: PrefillGraphs | None = None
        deterministic = config.device.deterministic
        eager_only, prompt_graphs = graph_modes(self.model, deterministic, self.mtp is not None)
        # several KV cache groups: the graphs' static inputs hold one block table
        eager_only = eager_only or len(self.kv_groups) > 1
        if self.device.type == "cuda" and not config.device.enforce_eager and not eager_only:
            max_len = config.model.max_model_len
            # steps that verify k drafts get graphs of 1 + k tokens a sequence where the model's attention can be
            # captured at that length (``multi_token_decode_graphs``); otherwise they run eagerly
            # (every length 1 + j, j <= k: a step whose sequences verify different draft counts is padded to its
            # longest, ``decode_padding``)
            k = config.speculative.num_speculative_tokens
            multi = tuple(range(2, 2 + k)) if k and getattr(self.model, "multi_token_decode_graphs", False) else ()
            self.graphs = DecodeGraphs(self.model, config.scheduler.max_num_seqs, -(-max_len // self.block_size),
                                       max_len, self.device, tokens_per_seq=(1, *multi),
                                       state_slots=bool(self.state_specs))
            # one graph runs at a time, so all share one memory pool, captured on one stream (the allocator reuses
            # a pool's free memory on the stream that freed it)
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
            with batch_invariant(deterministic):  # capture the kernels the eager steps run
                self.graphs.capture(pool, stream, (1,))
                max_tokens = min(config.device.max_prefill_graph_tokens, config.scheduler.max_num_batched_tokens)
                if max_tokens > 0 and prompt_graphs:
                    self.prefill_graphs = PrefillGraphs(self.model, max_tokens, max_len, self.block_size,
                                                        self.device)
                    self.prefill_graphs.capture(pool, stream)
                if multi:  # last: a capture that fails leaves the pool unusable for the captures after it
                    self.graphs.capture(pool, stream, multi)
        if self.device.type == "cuda" and not eager_only and prompt_graphs:
            with batch_invariant(deterministic):
                warm_up_prefill(self.model, config.scheduler.max_num_batched_tokens, config.model.max_model_len,
                                self.block_size, self.device)
        # confidence scheduling prices drafts on the step-latency curve: the saved one, else measured now
        self.step_latency_points: dict[int, float] = {}
        if config.speculative.enabled and config.speculative.confidence_scheduling:
            self.step_latency_points = self._step_latency_points(eager_only or not prompt_graphs)
        if self.eplb is not None:  # captures, warm-ups and measurements ran dummy batches
            self.eplb.reset_counters()

    def _step_latency_points(self, no_dummy_batches: bool) -> dict[int, float]:
        """The curve saved for this engine's fingerprint, or decode steps measured now (and saved); none for a
        model that cannot run dummy batches (the engine then builds the curve from its real steps)."""
        config = self.config
        path = step_latency.cache_path(config)
        saved = step_latency.StepLatencyCurve.load(path)
        if saved is not None:
            return saved.points
        if no_dummy_batches:
            return {}
        counts = step_latency.decode_token_counts(config.scheduler.max_num_seqs,
                                                  config.speculative.num_speculative_tokens,
                                                  config.scheduler.max_num_batched_tokens)
        try:
            with batch_invariant(config.device.deterministic):
                points = measure_step_latency(self.model, counts, config.model.max_model_len, self.block_size,
                                              self.device)
        except Exception as exc:  # noqa: BLE001 (a measurement must not stop the engine; real steps build it)
            logger.warning("step-latency measurement failed (%s: %s); the curve is built from real steps",
                           type(exc).__name__, exc)
            return {}
        if path is not None:
            step_latency.StepLatencyCurve(points).save(path)
        return points

    def _allocate_kv_caches(self, paged_layers: list, specs: list[KVCacheSpec]) -> None:
        """Each paged layer's cache (``specs``: theirs, in order); with several groups, the k-th layer of every
        group shares one tensor (a block id belongs to one group at a time), and each layer learns its group
        (``kv_group``)."""
        if not shares_tensors(specs, self.kv_groups):
            for layer, spec in zip(paged_layers, specs, strict=True):
                layer.kv_cache = spec.allocate(self.num_blocks, self.device)
        else:
            tensors = [specs[0].allocate(self.num_blocks, self.device)
                       for _ in range(max(len(group.layers) for group in self.kv_groups))]
            for group in self.kv_groups:
                for k, i in enumerate(group.layers):
                    paged_layers[i].kv_cache = tensors[k]
        if len(self.kv_groups) > 1:
            for g, group in enumerate(self.kv_groups):
                for i in group.layers:
                    paged_layers[i].kv_group = g

    @property
    def kv_bytes_per_token(self) -> int:
        return bytes_per_block(self.kv_specs, self.kv_groups) // self.block_size

    def _blocks_per_seq(self) -> int:
        """Blocks a max_model_len sequence holds at most: every block in a full group, the window (plus the
        drafts and a prompt chunk) in a sliding one."""
        reach = self.config.scheduler.max_num_batched_tokens + self.config.speculative.num_speculative_tokens
        return max_blocks_held(self.kv_group_windows, self.config.model.max_model_len, self.block_size, reach)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        per_block = bytes_per_block(self.kv_specs, self.kv_groups)
        blocks_per_seq = self._blocks_per_seq()
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        state_bytes = self.num_state_slots * sum(spec.bytes_per_slot for spec in self.state_specs)
        # the slots are taken first: every running request holds one
        budget = kv_budget_bytes(self.config, self.device) - state_bytes
        wanted = self.config.scheduler.max_num_seqs * blocks_per_seq + 1  # more could never be used
        num_blocks = min(budget // per_block, wanted) if per_block else wanted  # blocks that hold nothing
        if num_blocks < blocks_per_seq + 1:
            need = (blocks_per_seq + 1) * per_block / GiB
            raise ValueError(
                f"the KV cache budget ({budget / GiB:.2f} GiB) holds {num_blocks} blocks, fewer than one "
                f"max_model_len={self.config.model.max_model_len} sequence needs ({need:.2f} GiB): raise the "
                "KV memory (kv_cache_memory_gb / gpu_memory_utilization) or lower max_model_len")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), %d state slots (%.2f GiB)", num_blocks,
                    self.block_size, num_blocks * per_block / GiB, self.num_state_slots, state_bytes / GiB)
        return int(num_blocks)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Steps inside run the eager model, no graph (forward hooks, profiles, graph-against-eager checks)."""
        graphs, prefill_graphs = self.graphs, self.prefill_graphs
        self.graphs = self.prefill_graphs = None
        try:
            yield
        finally:
            self.graphs, self.prefill_graphs = graphs, prefill_graphs

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run one step and wait for its result (the synchronous path)."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Queue one step's GPU work (inputs, forward, sampling, copy of the tokens to the host); no host sync,
        except for prompt logprobs, which are scored at once."""
        cuda = self.device.type == "cuda"
        inputs = self.prepare(plan)
        if self.kv_transfer is not None and plan.kv_loads:
            self.kv_transfer.start(plan.kv_loads)
        if inputs is None:
            if self.parallel.dp_size > 1:
                self._dummy_moe()
                if self.eplb is not None:  # the step boundary every rank shares
                    self.eplb.end_step(mid_prefill=False)
            if self.kv_transfer is not None and plan.kv_saves:
                self.kv_transfer.save(plan.kv_saves)
            return StepHandle([], {}, {}, None, kv=self._kv_report(plan))
        start = torch.cuda.Event(enable_timing=True) if cuda and self.step_events is not None else None
        if start is not None:  # after the host built the inputs: a GPU waiting on the host shows as idle
            start.record()
        with batch_invariant(self.config.device.deterministic):
            logits, hidden = self._forward_with_hidden(inputs)
        if self.boundary_layers:
            self._save_boundaries(plan)
        copies: dict[str, torch.Tensor] = {}
        if inputs.sample_rows:
            # without prompt-logprob rows the logits rows are exactly the sampling rows
            rows = logits if not inputs.prompt_rows else logits[inputs.sample_logits_rows]
            sampled = self._sample(rows, inputs.sample_rows, copies, plan.grammar_bitmask)
            self._last_sampled = sampled
            # a request's last row holds its newest token (the only one a later step's placeholder stands for)
            self._last_rows = {row.state.request_id: i for i, row in enumerate(inputs.sample_rows)}
        if self.kv_transfer is not None and plan.kv_saves:  # after the forward: the gathers see its KV
            self.kv_transfer.save(plan.kv_saves)
        eplb_stats = self._eplb_step(plan, inputs, copies) if self.eplb is not None else None
        prompt_logprobs = {}
        for rows in inputs.prompt_rows:
            n = len(rows.target_ids)
            chunk = logits[rows.first_row:rows.first_row + n]
            targets = torch.tensor(rows.target_ids, device=chunk.device)
            prompt_logprobs[rows.request_id] = score_tokens(chunk, targets, rows.num_logprobs)
        done = None
        if cuda:
            done = torch.cuda.Event(enable_timing=start is not None)
            done.record()
            if start is not None:
                self.step_events.append((start, done, inputs.batch.num_seqs if inputs.batch.is_decode_only else -1))
        draft = None
        if self.mtp is not None and inputs.sample_rows:
            draft = functools.partial(self._draft, inputs, hidden)
        elif self.mtp is not None:  # prompt chunks only: nothing to draft, but their MTP KV is written now
            self._draft(inputs, hidden, [])
        handle = StepHandle(inputs.sample_rows, copies, prompt_logprobs, done, draft, self._kv_report(plan))
        handle.eplb_stats = eplb_stats
        return handle

    def _dummy_moe(self) -> None:
        """DP attention: a rank with nothing to compute this step still takes part in every MoE layer's
        exchange, with no tokens (the other ranks' forwards wait for it there); its attention has nothing to do."""
        hidden = self.config.model.hf_config["hidden_size"]
        empty = torch.empty(0, hidden, dtype=self.config.model.dtype, device=self.device)
        for layer in self.model.layers:  # the main model's MoE layers, in the forward's order (no MTP layers)
            if getattr(layer, "is_moe", False):
                layer.mlp(empty)

    def _eplb_step(self, plan: StepPlan, inputs: StepInputs, copies: dict[str, torch.Tensor]
                   ) -> dict[str, int] | None:
        """The step boundary of the expert load balancer; the window's loads on their way to the host when the
        plan asks for them, with the rebalances' totals (returned)."""
        sampled = {row.state.request_id for row in inputs.sample_rows}
        self.eplb.end_step(mid_prefill=any(rid not in sampled for rid in plan.num_scheduled_tokens))
        if not plan.want_expert_load:
            return None
        copies["expert_load"] = to_host(self.eplb.physical_load())
        return self.eplb.stats.as_dict()

    def _kv_report(self, plan: StepPlan) -> dict | None:
        """The KV store's part of the step's output: loads finished, host-tier changes, counters."""
        if self.kv_transfer is None:
            return None
        done = self.kv_transfer.finished(plan.kv_poll_s if plan.is_empty else 0.0)
        events, counters = self.kv_transfer.report()
        return {"kv_loads_done": done, "kv_host_events": events, "kv_store_counters": counters}

    def close(self) -> None:
        """Write the KV store's queued saves and stop its threads (idempotent)."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self.eplb is not None:
            self.eplb.close()

    @torch.inference_mode()
    def _draft(self, inputs: StepInputs, hidden: torch.Tensor, tokens: list[int]) -> tuple[dict, dict]:
        with batch_invariant(self.config.device.deterministic):
            return self.mtp.propose(inputs, hidden, tokens)

    def prepare(self, plan: StepPlan) -> StepInputs | None:
        """Apply the plan to the request table and build the step's inputs (None: nothing is scheduled); a new
        request that starts past its first token gets its state slot restored from its prefix's last block."""
        states = self.requests.apply(plan)
        for rid in plan.finished_req_ids + plan.preempted_req_ids:
            self._last_rows.pop(rid, None)
        for new in plan.new_requests:
            if new.state_slot >= 0 and new.num_computed_tokens > 0:
                self._restore_slot(new.state_slot, new.num_computed_tokens, new.block_ids[0])
        return build_step_inputs(states, plan, self.block_size, self.device) if states else None

    def _restore_slot(self, slot: int, num_computed: int, block_ids: list[int]) -> None:
        """The engine starts a request past 0 only at a block end (a prefix hit, a store load); a plan made by hand
        with a context computed elsewhere (benchmarks' decode steps) keeps the slot as it is."""
        if self.boundary_layers and num_computed % self.block_size == 0:
            block = block_ids[num_computed // self.block_size - 1]
            boundary_states.restore(self.boundary_layers, slot, num_computed, block)

    def _save_boundaries(self, plan: StepPlan) -> None:
        """After the forward: the block ends the step reached that the rings still hold (``boundary_states``)."""
        items, bs, requests = [], self.block_size, self.requests.requests
        for rid, num_new in plan.num_scheduled_tokens.items():
            state = requests[rid]
            start = state.num_computed_tokens
            if (start + num_new) // bs == start // bs:  # most decode steps: no block end reached
                continue
            for end in boundary_states.boundaries_after_step(start, num_new, bs, self.max_draft_tokens):
                items.append((state.state_slot, end, state.block_ids[0][end // bs - 1]))
        boundary_states.save(self.boundary_layers, items)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the step's logits rows (``_forward_with_hidden``'s first half)."""
        return self._forward_with_hidden(inputs)[0]

    def _forward_with_hidden(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the step's logits rows: a decode graph's replay when one fits (the step's sequences padded to
        its longest query where they differ, ``decode_padding``), else the prefill graphs of the step's token
        count when they fit, else the eager model; and the last hidden states of every row (None from a graph)."""
        batch = inputs.batch
        q = batch.max_query_len
        size = None  # the decode graph's batch size
        if self.graphs is not None and not inputs.prompt_rows:
            size = self.graphs.padded_size(batch.num_seqs, q)
        uniform = batch.num_tokens == batch.num_seqs * q  # every sequence has q tokens (1, or 1 + its drafts)
        padded = None
        if (not uniform and not inputs.prompt_rows and self._pads_steps
                and (size is not None or self.force_decode_padding)):
            padded = pad_step(inputs.host, q)  # None: a sequence has too few tokens before it
        if size is not None and (uniform or padded is not None):
            return self._replay(inputs, size, q, padded), None
        if padded is not None:  # forced (tests): the padded batch on the eager model
            return self._forward_padded(inputs, padded)
        self._fill_placeholders(batch.input_ids, inputs)
        graphs = self.prefill_graphs
        padded_tokens = None if graphs is None else graphs.padded_size(batch.num_tokens)
        if padded_tokens is not None:
            return self.model.compute_logits(graphs.run(padded_tokens, batch)[batch.logits_indices]), None
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.logits_indices]), hidden

    def _replay(self, inputs: StepInputs, size: int, q: int, padded: PaddedStep | None) -> torch.Tensor:
        """The decode graph of (``size``, ``q``) on the step's inputs (``padded``: laid out so); -> the logits of
        the step's logits rows."""
        batch = inputs.batch
        self.graphs.load_inputs(inputs.host if padded is None else padded.host, size, q)
        self._fill_placeholders(self.graphs.input_ids, inputs, None if padded is None else padded.rows)
        logits = self.graphs.replay(size, q)
        if padded is not None:  # the unpadded step's logits rows, in the padded batch
            (rows,) = to_device_packed([padded.host.logits_indices], self.device)
            return logits[rows]
        if len(inputs.sample_rows) == batch.num_tokens:  # every token samples: logits rows are rows 0..T-1
            return logits[:batch.num_tokens]
        return logits[batch.logits_indices]

    def _forward_padded(self, inputs: StepInputs, padded: PaddedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager model on the padded batch; -> the logits of the step's logits rows and the hidden states of
        its (unpadded) rows."""
        batch, rows = padded.to_device(self.device, inputs.batch.max_seq_len)
        self._fill_placeholders(batch.input_ids, inputs, padded.rows)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.logits_indices]), hidden[rows]

    @property
    def _pads_steps(self) -> bool:
        """Whether this model's steps of different query lengths may be padded: no per-sequence state (a padding
        token would advance it) and one KV cache group (the padded layout carries one slot mapping)."""
        return not self.state_specs and len(self.kv_groups) == 1

    @property
    def decode_padding(self) -> step_latency.DecodePadding:
        """Which steps run padded to their longest query (the decode graphs of every length 1..1 + k): what the
        engine's confidence scheduler prices them by."""
        graphs, longest = self.graphs, 1
        if graphs is None or not self._pads_steps:
            return step_latency.DecodePadding()
        while (graphs.max_size, longest + 1) in graphs.graphs:  # every length up to it captured
            longest += 1
        return step_latency.DecodePadding(graphs.max_size if longest > 1 else 0, longest)

    def _fill_placeholders(self, input_ids: torch.Tensor, inputs: StepInputs, rows: np.ndarray | None = None
                           ) -> None:
        """Async scheduling: copy tokens sampled by the previous step into this step's input ids, on device
        (``rows``: each unpadded row's row in ``input_ids``, for a padded step)."""
        if not inputs.placeholder_rows:
            return
        src = [self._last_rows[rid] for rid in inputs.placeholder_requests]
        dst = np.asarray(inputs.placeholder_rows, np.int64)
        dst, src = to_device_packed([dst if rows is None else rows[dst], np.asarray(src, np.int64)], self.device)
        input_ids.index_copy_(0, dst, self._last_sampled[src])

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], copies: dict[str, torch.Tensor],
                token_bitmask: np.ndarray | None = None) -> torch.Tensor:
        rejection = self.config.speculative.acceptance == "rejection"
        sbatch = build_sampling_batch(rows, self.vocab_size, self.device, token_bitmask, rejection)
        result = self.sampler(logits, sbatch)
        copies["tokens"] = to_host(result.token_ids)
        if result.logprobs is not None:
            copies["logprob_ids"] = to_host(result.logprob_token_ids)
            copies["logprobs"] = to_host(result.logprobs)
            copies["ranks"] = to_host(result.sampled_ranks)
        return result.token_ids
