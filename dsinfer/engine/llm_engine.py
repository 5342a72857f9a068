"""LLMEngine: requests in, RequestOutputs out; one ``step()`` schedules, runs the model once and applies results.

Input processing (validation, tokenizing, one request per sample) is ``InputProcessor``'s; the engine runs the
step loop: the scheduler writes a plain-data plan, the executor runs it (``distributed_executor_backend``: in
this process or in a worker process), and the engine applies the sampled tokens: 1 + (accepted drafts) per
request, checked for stops one by one (the first stop truncates the rest), rejected drafts rolled back.

With async scheduling (``DeviceConfig.async_scheduling``, on by default on CUDA) a step schedules and launches
step N+1 before it waits for step N's tokens, so the CPU prepares N+1 while the GPU runs N; N+1 reads N's tokens
on the device (placeholders). Stops, aborts and preemptions are then applied one step late: a request that
stopped at step N drops the token N+1 sampled for it. Requests whose sampling needs every earlier token on the
host (penalties, structured outputs), and an MTP drafter (its drafts follow the exact tokens), make the engine
drain the pipeline and step synchronously while they run. A drafter that proposes one token ahead (n-gram:
``engine.drafts``) composes with the overlap; a step that verified drafts is waited for before the next one is
scheduled (how many tokens it gave decides where the next step starts).

Confidence scheduling (``speculative_config.confidence_scheduling``) hands the scheduler a step-latency curve
(``core.step_latency``: the runner's start-up points, then each real step's time folded in, saved under the cache
directory every ``CURVE_SAVE_EVERY`` steps and at shutdown) and the drafts' calibrated confidences.

Bad input raises ``ValueError`` from ``add_request`` before anything reaches the scheduler, so one bad request
never disturbs the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from dsinfer.config import EngineConfig
from dsinfer.core import step_latency
from dsinfer.core.outputs import RunnerOutput
from dsinfer.core.request import RequestStatus
from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.engine.drafts import DraftProposer
from dsinfer.engine.input_processor import InputProcessor
from dsinfer.engine.output_processor import ChildState, LogprobDecoder, ParentRequest
from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.executor import make_executor
from dsinfer.executor.base import Executor, StepResult
from dsinfer.kvcache.grouped_manager import kv_cache_manager
from dsinfer.kvstore.index import StoreIndex
from dsinfer.kvstore.keys import engine_fingerprint
from dsinfer.scheduler.confidence import ConfidenceScheduler
from dsinfer.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from dsinfer.spec_decode import make_drafter
from dsinfer.spec_decode.base import Drafter
from dsinfer.tokenizer import Tokenizer

logger = logging.getLogger("dsinfer")
KV_POLL_S = 0.005  # a step with only KV store loads in flight waits this long for one to finish
CURVE_SAVE_EVERY = 512  # real steps between saves of the step-latency curve (confidence scheduling)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, drafter: Drafter | None = None,
                 executor: Executor | None = None):
        """``executor``: where the model runs (None: ``make_executor``'s for the config; a data-parallel rank's
        engine gets its rank's, ``engine.dp_engine``)."""
        self.config = config
        self.model_config = config.model
        self.tokenizer = tokenizer
        self.executor = executor if executor is not None else make_executor(config)
        # DP attention: a step with nothing to compute still runs (empty), the other ranks' MoE exchanges wait on it
        self.runs_empty_steps = config.parallel.data_parallel_size > 1
        self.num_empty_steps = 0
        num_blocks = self.executor.num_kv_blocks
        self.kv_manager = kv_cache_manager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                           self.executor.num_state_slots, self.executor.kv_group_windows,
                                           config.speculative.num_speculative_tokens)
        # the KV store's index (the worker holds the store itself): asked at admission, fed by each step's output
        self.store_index = (StoreIndex(config.kv_store, engine_fingerprint(config), config.cache.block_size,
                                       self.executor.kv_group_windows, self.executor.num_state_slots > 0)
                            if config.kv_store.enabled else None)
        self.kv_store_counters: dict[str, float] = {}  # the worker's latest totals
        # confidence scheduling: the step-latency curve the scheduler prices drafts on (None: off)
        self.step_latency: step_latency.StepLatencyCurve | None = None
        confidence = None
        if config.speculative.enabled and config.speculative.confidence_scheduling:
            self.step_latency = step_latency.StepLatencyCurve(self.executor.step_latency_points)
            confidence = ConfidenceScheduler(self.step_latency, padding=self.executor.decode_padding)
        self._curve_path = step_latency.cache_path(config) if self.step_latency is not None else None
        self._last_result_time = 0.0  # when the last step's result came back (a step's time starts no earlier)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.model.max_model_len,
                                   store=self.store_index, confidence=confidence)
        self.inputs = InputProcessor(config, tokenizer, num_blocks, self.executor.kv_group_windows)
        self.eos_token_ids, self.extra_eos_token_ids = self.inputs.eos_token_ids, self.inputs.extra_eos_token_ids
        # proposes drafts for each running request (config.speculative.num_speculative_tokens at most a step);
        # None: the one of config.speculative (none when speculation is off)
        self.drafter = drafter if drafter is not None else make_drafter(config)
        k = config.speculative.num_speculative_tokens
        self.drafts = (DraftProposer(self.drafter, k, lambda: self._structured)
                       if self.drafter is not None and k > 0 else None)
        self.spec_stats = self.drafts.stats if self.drafts is not None else None
        self._parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, ChildState]] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._early_outputs: list[RequestOutput] = []  # preset first tokens' outputs: the next step's, at once
        self._logprob_decoder = LogprobDecoder(tokenizer)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.async_scheduling = config.device.async_scheduling
        # launched, result not yet applied: the step, its requests that sample, the executor's handle, launch time
        self._in_flight: tuple[SchedulerOutput, list[ScheduledRequest], StepResult, float] | None = None
        # overlap with drafts: only a drafter that can propose one token ahead of the tokens it sees
        self._overlaps_drafts = self.drafter is None or getattr(self.drafter, "proposes_ahead", False)
        self._needs_host_tokens: set[str] = set()  # unfinished child ids whose sampling reads earlier tokens
        # EPLB: the worker's latest expert-load window (asked for by the next plan after each ``get_stats``)
        self.expert_load: list[list[float]] | None = None
        self.eplb_counters: dict[str, int] | None = None  # rank 0's rebalance totals, with the expert load
        self._want_expert_load = config.parallel.enable_eplb

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage: str = "offline") -> LLMEngine:
        return cls(*cls.config_and_tokenizer(args, usage))

    @staticmethod
    def config_and_tokenizer(args: EngineArgs, usage: str = "offline") -> tuple[EngineConfig, Tokenizer | None]:
        """The engine config of ``args`` and the model's tokenizer (None, with a warning, when it has none)."""
        config = args.create_engine_config(usage)
        tok_dir = args.tokenizer or config.model.path
        tokenizer = None
        try:
            tokenizer = Tokenizer.from_dir(tok_dir, config.model.eos_token_ids)
        except FileNotFoundError:
            logger.warning("no tokenizer in %s: only token-id prompts are accepted", tok_dir)
        return config, tokenizer

    @property
    def runner(self) -> Any:
        """The ModelRunner, when it runs in this process (``distributed_executor_backend="uni"``)."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError("the model runs in worker processes (distributed_executor_backend="
                                 f"{self.config.parallel.distributed_executor_backend!r}): no runner here")
        return runner

    @property
    def _structured(self) -> Any:
        return self.inputs.structured

    def shutdown(self) -> None:
        """Stop the executor's workers (idempotent) and save the step-latency curve."""
        self._save_curve()
        self.executor.shutdown()

    def _save_curve(self) -> None:
        if self._curve_path is not None and self.step_latency.ready:
            try:
                self.step_latency.save(self._curve_path)
            except OSError as exc:
                logger.warning("could not save the step-latency curve to %s: %s", self._curve_path, exc)

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, first_token: int | None = None) -> None:
        """``priority``: under the "priority" scheduling policy, lower runs first (vLLM's); must be 0 otherwise.
        ``arrival_time``: ``time.monotonic()`` (every request time is on that clock); None: now.
        ``first_token``: the first output token, sampled elsewhere (prefill/decode disaggregation: the prefill
        replica's): appended at once, its output returned by the next ``step`` before that step computes anything;
        the request then computes its prompt and that token and samples the second (see ``_preset_first``)."""
        self.check_priority(priority)
        if first_token is not None:
            self.inputs.check_first_token(first_token, params)
        if request_id in self._parents or request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > 1:  # its samples run as "<id>#<index>": none may be the id of a request already running
            clash = next((cid for i in range(params.n) if (cid := f"{request_id}#{i}") in self._children), None)
            if clash is not None:
                raise ValueError(f"request id {request_id!r} is already in use: its sample {clash!r} is a running "
                                 "request's id")
        parent = self.inputs.process(request_id, prompt, params, arrival_time, priority)
        for child in parent.children:
            rid = child.request.request_id
            if child.needs_host_tokens:
                self._needs_host_tokens.add(rid)
            self._children[rid] = (parent, child)
            self.scheduler.add_request(child.request)
        self._parents[request_id] = parent
        if first_token is not None:
            self._preset_first(parent, first_token)

    def _preset_first(self, parent: ParentRequest, token: int) -> None:
        """``token`` appended as the request's first output (its stops checked as a sampled token's), and the
        output it makes queued for the next ``step`` to return first."""
        child = parent.children[0]
        status = self._append(child, token, None)
        if status is not None:
            self.scheduler.finish(child.request, status)
        output = parent.make_output(parent.finished)
        if parent.finished:
            self._finish_parent(parent, emit=False)
        if output is not None:
            self._early_outputs.append(output)

    def check_priority(self, priority: Any) -> None:
        """A ValueError unless ``priority`` is one ``add_request`` takes under this engine's policy."""
        self.inputs.check_priority(priority)

    def _fail_uncompilable(self) -> None:
        """Requests whose grammar failed to compile (after passing validation) finish as aborted."""
        for request, error in self._structured.take_failed() if self._structured is not None else []:
            logger.warning("request %s: its grammar failed to compile: %s", request.request_id, error)
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            parent, _ = self._children[request.request_id]
            if parent.finished:
                self._finish_parent(parent)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            for child in parent.children:
                if not child.request.is_finished:
                    self.scheduler.finish(child.request, RequestStatus.FINISHED_ABORTED)
            self._finish_parent(parent)

    def abort_all(self) -> None:
        """Abort every request and drop the step in flight and the outputs not yet returned: the state after a
        step that raised (an interrupt, out of memory) is not trusted, so none of it is resumed, and the prefix
        cache is emptied. The engine then takes new requests."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:  # let the device finish the step before its KV blocks are reused
            with contextlib.suppress(Exception):
                in_flight[2].result()
        self.abort_request(list(self._parents))
        self._pending_outputs = []
        self._early_outputs = []
        # the failed step's blocks joined the prefix cache when it was scheduled, but their KV may never have been
        # written: every block is free now, so forget every cached prefix rather than serve garbage KV later
        self.kv_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return (bool(self._parents) or bool(self._pending_outputs) or bool(self._early_outputs)
                or self._in_flight is not None)

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        if self._early_outputs:  # preset first tokens: out before any step runs (their time to first token)
            early, self._early_outputs = self._early_outputs, []
            return early
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.async_scheduling and not self._needs_host_tokens and self._overlaps_drafts:
            return outputs + self._step_overlapped()
        outputs += self._finish_step(self._in_flight)  # drain the pipeline before a synchronous step
        self._in_flight = None
        self._fail_uncompilable()
        self._propose_drafts()
        sched = self._schedule()
        if sched.is_empty and not self._has_store_work(sched):
            if self.runs_empty_steps:
                self.executor.execute(sched.plan)
                self.num_empty_steps += 1
            return outputs
        started = time.perf_counter()
        result = self.executor.execute(sched.plan)
        self._observe_step_time(sched, started)
        return outputs + self._process(sched, result)

    def _has_store_work(self, sched: SchedulerOutput) -> bool:
        """A step with nothing to compute still runs when the KV store has work in it, or loads to hear of (the
        worker then waits a moment for one: ``KV_POLL_S``)."""
        plan = sched.plan
        if not (plan.kv_loads or plan.kv_saves or self.scheduler.loading):
            return False
        plan.kv_poll_s = KV_POLL_S if self.scheduler.loading else 0.0
        return True

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch step N+1, then wait for step N (the one host sync) and apply its tokens. A step N that
        verifies drafts is waited for first: N+1 starts where N's accepted tokens end."""
        outputs = []
        if self._in_flight is not None and self._in_flight[0].plan.draft_token_ids:
            outputs, self._in_flight = self._finish_step(self._in_flight), None
        self._propose_drafts()
        sched = self._schedule()
        launched = None
        if not sched.is_empty or self._has_store_work(sched):
            handle = self.executor.launch(sched.plan)
            sampling = [item for item in sched.scheduled if item.samples]
            for item in sampling:
                item.request.num_pending += 1  # the scheduler counts it; the next step reads it on the device
            launched = (sched, sampling, handle, time.perf_counter())
        previous, self._in_flight = self._in_flight, launched
        return outputs + self._finish_step(previous)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if self._want_expert_load and not sched.is_empty:
            sched.plan.want_expert_load, self._want_expert_load = True, False
        if self._structured is not None and not sched.is_empty:
            sched.plan.grammar_bitmask = self._grammar_bitmask(sched.scheduled)
        return sched

    def _grammar_bitmask(self, scheduled: list[ScheduledRequest]) -> np.ndarray | None:
        """One row per sampled position: a grammar request's mask after each prefix of its drafts (the grammar
        manager's), -1 rows for requests without a grammar."""
        mask = self._structured.bitmask(scheduled)
        return None if mask is None else mask.numpy()

    def _propose_drafts(self) -> None:
        if self.drafts is not None:
            self.drafts.propose(self.scheduler.running)

    def _finish_step(self, step: tuple[SchedulerOutput, list[ScheduledRequest], StepResult, float] | None
                     ) -> list[RequestOutput]:
        if step is None:
            return []
        sched, sampling, handle, launched = step
        result = handle.result()
        self._observe_step_time(sched, launched)
        for item in sampling:
            item.request.num_pending -= 1
        return self._process(sched, result)

    def _observe_step_time(self, sched: SchedulerOutput, started: float) -> None:
        """Fold the step just finished into the step-latency curve: from its launch, or from the previous
        step's result when it was queued behind that one (overlap)."""
        now = time.perf_counter()
        if self.step_latency is not None:
            # a step the runner padded to its longest query costs that many tokens (``DecodePadding``)
            tokens = self.executor.decode_padding.step_tokens([item.num_new_tokens for item in sched.scheduled])
            self.step_latency.observe(tokens, now - max(started, self._last_result_time))
            if self.step_latency.num_observed % CURVE_SAVE_EVERY == 0:
                self._save_curve()
        self._last_result_time = now

    def _process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        if result.expert_load is not None:
            self.expert_load, self.eplb_counters = result.expert_load, result.eplb_stats
        if self.store_index is not None:
            self.store_index.apply([(key, present) for key, present in result.kv_host_events])
            self.kv_store_counters = result.kv_store_counters or self.kv_store_counters
            if result.kv_loads_done:
                self.scheduler.loads_done(result.kv_loads_done)
        outputs: list[RequestOutput] = []
        touched: dict[str, ParentRequest] = {}
        for item in sched.scheduled:
            if item.request.is_finished:  # stopped or aborted while this step ran: its token is dropped
                continue
            parent, child = self._children[item.request.request_id]
            self._apply(item, child, result)
            touched[parent.request_id] = parent
        for parent in touched.values():
            finished = parent.finished
            output = parent.make_output(finished)
            if finished:
                self._finish_parent(parent, emit=False)
            if output is not None:
                outputs.append(output)
        return outputs

    def _apply(self, item: ScheduledRequest, child: ChildState, result: RunnerOutput) -> None:
        request = child.request
        rid = request.request_id
        if result.prompt_logprobs and rid in result.prompt_logprobs:
            request.prompt_logprobs.extend(self._logprob_decoder.position(p) for p in result.prompt_logprobs[rid])
        tokens = result.sampled_token_ids.get(rid)
        if not tokens:
            return
        if item.draft_token_ids:
            self.scheduler.rollback(request, len(item.draft_token_ids) + 1 - len(tokens))
            self.drafts.observe(request, len(item.draft_token_ids), len(tokens) - 1)
        logprobs = result.logprobs.get(rid) if result.logprobs else None
        for i, token in enumerate(tokens):
            status = self._append(child, token, logprobs[i] if logprobs else None)
            if status is not None:  # the first stop ends the run: later tokens are dropped
                self.scheduler.finish(request, status)
                return
        if rid in result.draft_token_ids:  # drafts the worker computed (MTP): they follow the tokens just appended
            self.drafter.receive(request, result.draft_token_ids[rid], result.draft_confidence[rid])

    def _append(self, child: ChildState, token: int, logprobs: Any) -> RequestStatus | None:
        """Append one sampled token; -> the status it finishes the request with (None: it goes on)."""
        request = child.request
        request.append_token(token)
        self.num_generation_tokens += 1
        if request.num_output_tokens == 1:
            request.first_token_time = time.monotonic()
            self.num_prompt_tokens += request.num_prompt_tokens
        if logprobs is not None:
            request.logprobs.append(self._logprob_decoder.position(logprobs))
            request.cumulative_logprob += logprobs.logprobs[0]
        # A grammar ends on the EOS it lets through once complete (vLLM's way): that EOS stops the request as any
        # EOS does, even before min_tokens or with ignore_eos (the grammar's end wins; see SamplingParams)
        grammar_state = self._structured.advance(request) if request.grammar is not None else "continue"
        status = self._stop_status(child, token, grammar_end=grammar_state == "complete")
        if status is None and grammar_state == "rejected":
            status = RequestStatus.FINISHED_ABORTED
        return status

    def _stop_status(self, child: ChildState, token: int, grammar_end: bool = False) -> RequestStatus | None:
        request, params = child.request, child.request.params
        past_min = request.num_output_tokens >= params.min_tokens
        eos = grammar_end or (past_min and token in request.eos_token_ids and not params.ignore_eos)
        stop_token = past_min and token in params.stop_token_ids
        # a stop string the text now holds, searched for once the output is longer than min_tokens (vLLM's
        # detokenizer: the text of the first min_tokens tokens never stops it)
        stop_str = None
        # A stop token ends the text without its own text (EOS with skip_special_tokens=False included), unless
        # include_stop_str_in_output, as vLLM; its id stays in token_ids
        if child.detokenizer and (not (eos or stop_token) or params.include_stop_str_in_output):
            check = request.num_output_tokens > params.min_tokens and not (eos or stop_token)
            stop_str = child.detokenizer.add_token(token, check)
        if eos:
            if token in self.extra_eos_token_ids:  # vLLM makes these stop tokens: the id is the stop_reason
                request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if stop_token:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if stop_str is not None:
            request.stop_reason = stop_str
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.model_config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish_parent(self, parent: ParentRequest, emit: bool = True) -> None:
        parent.mark_finished_time()
        if emit:
            output = parent.make_output()
            if output is not None:
                self._pending_outputs.append(output)
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._children.pop(child.request.request_id, None)
            self._needs_host_tokens.discard(child.request.request_id)

    # ----------------------------------------------------------------- introspection
    def get_stats(self) -> dict[str, Any]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            # prompt tokens the waiting requests still have to compute (the server's --max-waiting-tokens)
            "num_waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting),
            "kv_cache_usage": self.kv_manager.usage,
            # the attention cost of the next decode step: KV tokens the running requests hold (the router's load)
            "num_kv_tokens": sum(r.num_computed_tokens for r in self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv_manager.prefix_queries,
            "prefix_cache_hits": self.kv_manager.prefix_hits,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "spec_decode": self.spec_stats.as_dict() if self.spec_stats is not None else None,
            "kv_store": self.kv_store_stats(),
            "eplb": self.eplb_stats(),
        }

    def eplb_stats(self) -> dict[str, Any] | None:
        """moe_lb per MoE layer and overall (over the expert-parallel ranks) from the latest expert-load window,
        and the rebalances' totals (None: EPLB off or no window yet); asks the next step for a fresh one (the
        figures are one call behind)."""
        if not self.config.parallel.enable_eplb:
            return None
        self._want_expert_load = True
        if self.expert_load is None:
            return None
        from dsinfer.distributed.eplb.planner import load_summary

        return load_summary(self.expert_load, self.eplb_counters or {}, self.config.parallel.expert_parallel_size)

    def flush_kv_store(self) -> None:
        """Wait until the KV store's queued saves are written, and let the index know them now (the in-process
        runner only: tests and benchmarks that want the next request to hit what the last one saved)."""
        transfer = self.runner.kv_transfer
        if transfer is None:
            return
        transfer.store.flush()
        self.store_index.apply(transfer.store.host_events())
        self.kv_store_counters = transfer.store.counters.snapshot()

    def wait_kv_saves(self) -> bool:
        """Block until the KV store's queued saves are written (any thread: the queue's join); False when the store
        is not in this process (no store, or an mp worker's). The router's prefill replicas answer after it, so
        that the decode replica finds the prompt's grains in the shared directory."""
        transfer = getattr(getattr(self.executor, "runner", None), "kv_transfer", None)
        if transfer is None:
            return False
        transfer.store.flush()
        return True

    def kv_store_stats(self) -> dict[str, float] | None:
        """The KV store's counters (``kvstore.counters``: the worker's, with the index's lookups); None: no store."""
        if self.store_index is None:
            return None
        stats = dict(self.kv_store_counters)
        index = self.store_index.counters.snapshot()
        stats["lookups"] = index["lookups"]
        stats["expiries"] = stats.get("expiries", 0) + index["expiries"]
        return stats
