"""LLMEngine: requests in, RequestOutputs out; one ``step()`` schedules, runs the model once and applies results.

With async scheduling (``DeviceConfig.async_scheduling``, on by default on CUDA) a step schedules and launches
step N+1 before it waits for step N's tokens, so the CPU prepares N+1 while the GPU runs N; N+1 reads N's tokens
on the device (placeholders). Stops, aborts and preemptions are then applied one step late: a request that
stopped at step N drops the token N+1 sampled for it. Requests whose sampling needs every earlier token on the
host (penalties, structured outputs) make the engine drain the pipeline and step synchronously while they run.

Bad input raises ``ValueError`` from ``add_request`` before anything reaches the scheduler, so one bad request
never disturbs the others.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterable
from typing import Any

from dsinfer.config import EngineArgs, EngineConfig
from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.output_processor import ChildState, LogprobDecoder, ParentRequest
from dsinfer.engine.outputs import RequestOutput
from dsinfer.core.request import Request, RequestStatus
from dsinfer.engine.sampling_params import SamplingParams, token_id_list, truncate_prompt
from dsinfer.kvcache.manager import KVCacheManager
from dsinfer.runner.model_runner import ModelRunner, RunnerOutput, StepHandle
from dsinfer.scheduler.scheduler import Scheduler, SchedulerOutput
from dsinfer.tokenizer import Tokenizer

logger = logging.getLogger("dsinfer")

_INT64_MASK = (1 << 64) - 1


def _wrap_int64(value: int) -> int:
    value &= _INT64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _split_eos_ids(listed: list[int], tokenizer: Tokenizer | None) -> tuple[frozenset[int], frozenset[int]]:
    """(every id that ends a request as EOS does, the ones among them that vLLM treats as stop tokens).

    vLLM's split (``SamplingParams.update_from_generation_config``): the tokenizer's eos_token is the EOS; the other
    ids the model's eos_token_id lists (Llama 3 instruct's 128001 and 128008 beside <|eot_id|>) become stop tokens,
    so an output they end has stop_reason = that id, and ignore_eos stops on none of them. While min_tokens holds,
    both kinds are banned, with ignore_eos too (vLLM's ``all_stop_token_ids``; ``runner.input_batch``).
    Without a tokenizer eos_token vLLM has no EOS at all; dsinfer then keeps every listed id a plain EOS rather than
    report an id for a model's only end token.
    """
    listed = list(listed) or (tokenizer.eos_token_ids if tokenizer is not None else [])
    primary = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer is not None and tokenizer.eos_token else None
    if primary is None:
        return frozenset(listed), frozenset()
    return frozenset(listed) | {primary}, frozenset(listed) - {primary}


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None):
        self.config = config
        self.model_config = config.model
        self.tokenizer = tokenizer
        self.runner = ModelRunner(config)
        self.kv_manager = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                         config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.model.max_model_len)
        self._parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, ChildState]] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._seed_rng = random.Random(config.load.seed)
        self._logprob_decoder = LogprobDecoder(tokenizer)
        self.eos_token_ids, self.extra_eos_token_ids = _split_eos_ids(config.model.eos_token_ids, tokenizer)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.async_scheduling = config.device.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None  # launched, result not yet applied
        self._needs_host_tokens: set[str] = set()  # unfinished child ids whose sampling reads earlier tokens
        self._structured: Any = None  # StructuredOutputManager, made (importing xgrammar) on first use

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage: str = "offline") -> LLMEngine:
        config = args.create_engine_config(usage)
        tok_dir = args.tokenizer or config.model.path
        tokenizer = None
        try:
            tokenizer = Tokenizer.from_dir(tok_dir, config.model.eos_token_ids)
        except FileNotFoundError:
            logger.warning("no tokenizer in %s: only token-id prompts are accepted", tok_dir)
        return cls(config, tokenizer)

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """``priority``: under the "priority" scheduling policy, lower runs first (vLLM's); must be 0 otherwise."""
        self.check_priority(priority)
        if request_id in self._parents or request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > 1:  # its samples run as "<id>#<index>": none may be the id of a request already running
            clash = next((cid for i in range(params.n) if (cid := f"{request_id}#{i}") in self._children), None)
            if clash is not None:
                raise ValueError(f"request id {request_id!r} is already in use: its sample {clash!r} is a running "
                                 "request's id")
        params = params.with_vocab_logprobs(self.model_config.vocab_size)
        params.check_logprobs_limit(self.model_config.logprobs_limit)
        text, token_ids = self._prompt_ids(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len)
        max_tokens = self._check_lengths(token_ids, params)
        params.validate_for_vocab(self.model_config.vocab_size)
        grammar = self._prepare_grammar(params)
        bad_word_ids = self._bad_word_ids(params)
        self._check_something_samplable(params, bad_word_ids)
        parent = ParentRequest(request_id, text, token_ids, params, arrival_time or time.monotonic())
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(child_id, token_ids, params, _wrap_int64(base_seed + index), max_tokens,
                              self.eos_token_ids, text, parent.arrival_time, request_id, index, priority,
                              needs_prompt_logprobs=params.prompt_logprobs is not None)
            if params.prompt_logprobs is not None:
                request.prompt_logprobs = [None]
            if grammar is not None:
                request.grammar = self._structured.request_grammar(request, *grammar)
            request.bad_word_ids = bad_word_ids
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
                                               params.include_stop_str_in_output)
            child = ChildState(request, detok)
            # sampling that reads the last outputs (penalties, grammars, a bad word's first tokens) waits for them
            if params.uses_penalties or params.structured_outputs is not None or any(
                    len(ids) > 1 for ids in bad_word_ids):
                self._needs_host_tokens.add(child_id)
            parent.children.append(child)
            self._children[child_id] = (parent, child)
            self.scheduler.add_request(request)
        self._parents[request_id] = parent

    def check_priority(self, priority: Any) -> None:
        """A ValueError unless ``priority`` is one ``add_request`` takes under this engine's policy."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(1 << 31) <= priority < 1 << 31:
            raise ValueError(f"priority must be an integer in [-2**31, 2**31), got {priority!r}")
        if priority and self.config.scheduler.policy != "priority":
            raise ValueError(f"priority={priority}, but priority scheduling is not enabled: start the engine with "
                             "scheduling_policy='priority' (--scheduling-policy priority)")

    def _bad_word_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer, and this model has none")
        return bad_word_token_ids(self.tokenizer, params.bad_words)

    def _check_something_samplable(self, params: SamplingParams, bad_word_ids) -> None:
        """An allowed set that the bans empty would sample from nothing: a ValueError instead."""
        if not params.allowed_token_ids:
            return
        left = set(params.allowed_token_ids) - {ids[0] for ids in bad_word_ids if len(ids) == 1}
        if not left:
            raise ValueError("allowed_token_ids holds only tokens that bad_words ban: nothing could be sampled")
        stops = set(params.stop_token_ids) | set(self.eos_token_ids)  # what min_tokens bans, ignore_eos or not
        if params.min_tokens and left <= stops:
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens bans until "
                             f"{params.min_tokens} tokens are out: nothing could be sampled")

    def _prepare_grammar(self, params: SamplingParams) -> tuple[Any, Any] | None:
        """Validate a structured-output constraint and start compiling it; ValueError when invalid."""
        if params.structured_outputs is None:
            return None
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            try:
                from dsinfer.structured.manager import StructuredOutputManager
            except ImportError as exc:
                raise ValueError("structured outputs need xgrammar (pip install 'dsinfer[structured]'): "
                                 f"{exc}") from None
            self._structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                       self.eos_token_ids)
        return self._structured.prepare(params.structured_outputs)

    def _fail_uncompilable(self) -> None:
        """Requests whose grammar failed to compile (after passing validation) finish as aborted."""
        for request, error in self._structured.take_failed() if self._structured is not None else []:
            logger.warning("request %s: its grammar failed to compile: %s", request.request_id, error)
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            parent, _ = self._children[request.request_id]
            if parent.finished:
                self._finish_parent(parent)

    def _prompt_ids(self, prompt: str | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = token_id_list(prompt["prompt_token_ids"])
            vocab = self.model_config.vocab_size
            if ids is None:
                raise ValueError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {vocab})")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return self._prompt_ids(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, got "
                         f"{type(prompt).__name__}")

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        limit = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(token_ids) >= limit:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {limit}, which must leave "
                             "room for at least one output token")
        # as vLLM offline: output past the context is cut there (finish reason "length"); the server answers an
        # explicit max_tokens over the context with a 400 before it gets here
        room = limit - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # a request that could never fit in the whole KV cache would wait forever
        block_size, usable = self.config.cache.block_size, self.runner.num_blocks - 1
        needed = -(-(len(token_ids) + max_tokens - 1) // block_size)
        if needed > usable:
            asked = str(max_tokens) if params.max_tokens == max_tokens else f"{max_tokens}: the context's room"
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({asked}) needs {needed} "
                             f"KV blocks of {block_size} tokens; the KV cache has {usable} (raise "
                             "num_kv_blocks or kv_cache_memory_gb, or lower max_tokens)")
        return max_tokens

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
                in_flight[1].result()
        self.abort_request(list(self._parents))
        self._pending_outputs = []
        # the failed step's blocks joined the prefix cache when it was scheduled, but their KV may never have been
        # written: every block is free now, so forget every cached prefix rather than serve garbage KV later
        self.kv_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending_outputs) or self._in_flight is not None

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.async_scheduling and not self._needs_host_tokens:
            return outputs + self._step_overlapped()
        outputs += self._finish_step(self._in_flight)  # drain the pipeline before a synchronous step
        self._in_flight = None
        self._fail_uncompilable()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        if self._structured is not None:
            sched.grammar_bitmask = self._structured.bitmask(sched.scheduled)
        return outputs + self._process(sched, self.runner.execute(sched))

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch step N+1, then wait for step N (the one host sync) and apply its tokens."""
        sched = self.scheduler.schedule()
        launched = None
        if not sched.is_empty:
            handle = self.runner.launch(sched)
            for item in handle.sample_items:
                item.request.num_pending += 1  # the scheduler counts it; the next step reads it on the device
            launched = (sched, handle)
        previous, self._in_flight = self._in_flight, launched
        return self._finish_step(previous)

    def _finish_step(self, step: tuple[SchedulerOutput, StepHandle] | None) -> list[RequestOutput]:
        if step is None:
            return []
        sched, handle = step
        result = handle.result()
        for item in handle.sample_items:
            item.request.num_pending -= 1
        return self._process(sched, result)

    def _process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        touched: dict[str, ParentRequest] = {}
        for item in sched.scheduled:
            if item.request.is_finished:  # stopped or aborted while this step ran: its token is dropped
                continue
            parent, child = self._children[item.request.request_id]
            self._apply(child, result)
            touched[parent.request_id] = parent
        for parent in touched.values():
            output = parent.make_output()
            if parent.finished:
                self._finish_parent(parent, emit=False)
            if output is not None:
                outputs.append(output)
        return outputs

    def _apply(self, child: ChildState, result: RunnerOutput) -> None:
        request = child.request
        rid = request.request_id
        if rid in result.prompt_logprobs:
            request.prompt_logprobs.extend(self._logprob_decoder.position(p) for p in result.prompt_logprobs[rid])
        token = result.sampled.get(rid)
        if token is None:
            return
        request.append_token(token)
        self.num_generation_tokens += 1
        if request.num_output_tokens == 1:
            request.first_token_time = time.monotonic()
            self.num_prompt_tokens += request.num_prompt_tokens
        if rid in result.logprobs:
            data = result.logprobs[rid]
            request.logprobs.append(self._logprob_decoder.position(data))
            request.cumulative_logprob += data.logprobs[0]
        # A grammar ends on the EOS it lets through once complete (vLLM's way): that EOS stops the request as any
        # EOS does, even before min_tokens or with ignore_eos (the grammar's end wins; see SamplingParams)
        grammar_state = self._structured.advance(request) if request.grammar is not None else "continue"
        status = self._stop_status(child, token, grammar_end=grammar_state == "complete")
        if status is None and grammar_state == "rejected":
            status = RequestStatus.FINISHED_ABORTED
        if status is not None:
            self.scheduler.finish(request, status)

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
            "kv_cache_usage": self.kv_manager.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv_manager.prefix_queries,
            "prefix_cache_hits": self.kv_manager.prefix_hits,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
        }


def bad_word_token_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token sequences, as vLLM bans them: the word alone, and with a leading space when that
    is a different first token of the same length (the word inside a sentence). A sequence's last token is
    banned when the output so far ends with the rest of it."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (bare, spaced) if spaced[:1] != bare[:1] and len(spaced) == len(bare) else (bare,):
            if ids and ids not in seqs:
                seqs.append(ids)
    return tuple(seqs)

