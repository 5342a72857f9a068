"""Input processing: a user's prompt and SamplingParams -> validated engine requests (one per sample of n).

Everything that can be wrong with a request is found here, before anything reaches the scheduler, and raised as
a ``ValueError`` that names the field, so one bad request never disturbs the others.
"""

from __future__ import annotations

import random
import time
from typing import Any

from dsinfer.config import EngineConfig
from dsinfer.core.kv_cache_spec import max_blocks_held
from dsinfer.core.plan import RequestSampling
from dsinfer.core.request import Request
from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.output_processor import ChildState, ParentRequest
from dsinfer.engine.sampling_params import SamplingParams, token_id_list, truncate_prompt
from dsinfer.tokenizer import Tokenizer

_INT64_MASK = (1 << 64) - 1


def _wrap_int64(value: int) -> int:
    value &= _INT64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def split_eos_ids(listed: list[int], tokenizer: Tokenizer | None) -> tuple[frozenset[int], frozenset[int]]:
    """(every id that ends a request as EOS does, the ones among them that vLLM treats as stop tokens).

    vLLM's split (``SamplingParams.update_from_generation_config``): the tokenizer's eos_token is the EOS; the other
    ids the model's eos_token_id lists (Llama 3 instruct's 128001 and 128008 beside <|eot_id|>) become stop tokens,
    so an output they end has stop_reason = that id, and ignore_eos stops on none of them. While min_tokens holds,
    both kinds are banned, with ignore_eos too (vLLM's ``all_stop_token_ids``; ``core.plan.RequestSampling``).
    Without a tokenizer eos_token vLLM has no EOS at all; dsinfer then keeps every listed id a plain EOS rather than
    report an id for a model's only end token.
    """
    listed = list(listed) or (tokenizer.eos_token_ids if tokenizer is not None else [])
    primary = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer is not None and tokenizer.eos_token else None
    if primary is None:
        return frozenset(listed), frozenset()
    return frozenset(listed) | {primary}, frozenset(listed) - {primary}


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, num_kv_blocks: int,
                 kv_group_windows: tuple[int | None, ...] = (None,)):
        """``kv_group_windows``: the KV cache groups' sliding windows (None: full attention), as the KV manager."""
        self.config = config
        self.kv_group_windows = kv_group_windows
        self.model_config = config.model
        self.tokenizer = tokenizer
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids, self.extra_eos_token_ids = split_eos_ids(config.model.eos_token_ids, tokenizer)
        self._seed_rng = random.Random(config.load.seed)
        self.structured: Any = None  # StructuredOutputManager, made (importing xgrammar) on first use

    def process(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams,
                arrival_time: float | None, priority: int) -> ParentRequest:
        """The request as the engine runs it: a parent with one child ``Request`` per sample."""
        self.check_priority(priority)
        params = params.with_vocab_logprobs(self.model_config.vocab_size)
        params.check_logprobs_limit(self.model_config.logprobs_limit)
        text, token_ids = self._prompt_ids(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.model_config.max_model_len)
        max_tokens = self._check_lengths(token_ids, params)
        params.validate_for_vocab(self.model_config.vocab_size)
        grammar = self._prepare_grammar(params)
        bad_word_ids = self._bad_word_ids(params)
        self._check_something_samplable(params, bad_word_ids)
        kv_ttl_s = self.config.kv_store.ttl_of(params.kv_retention)  # ValueError for a class it lacks
        parent = ParentRequest(request_id, text, token_ids, params, arrival_time or time.monotonic())
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = _wrap_int64(base_seed + index)
            request = Request(child_id, token_ids, params, seed, max_tokens, self.eos_token_ids, text,
                              parent.arrival_time, request_id, index, priority,
                              sampling=RequestSampling.of(params, seed, self.eos_token_ids, bad_word_ids))
            if params.prompt_logprobs is not None:
                request.prompt_logprobs = [None]
            request.kv_ttl_s = kv_ttl_s
            if grammar is not None:
                request.grammar = self.structured.request_grammar(request, *grammar)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
                                               params.include_stop_str_in_output)
            # sampling that reads the last outputs (penalties, grammars, a bad word's first tokens) waits for them
            needs_host = params.uses_penalties or params.structured_outputs is not None or any(
                len(ids) > 1 for ids in bad_word_ids)
            parent.children.append(ChildState(request, detok, needs_host_tokens=needs_host))
        return parent

    def check_first_token(self, token: int, params: SamplingParams) -> None:
        """A ValueError unless a preset first token can stand for the request's first sample: one sample, no
        logprobs (none were computed for it), no grammar (it would have to have advanced it)."""
        vocab = self.model_config.vocab_size
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"first_token must be a token id in [0, {vocab}), got {token!r}")
        if params.n != 1:
            raise ValueError(f"a preset first token needs n=1, got n={params.n}")
        if params.logprobs is not None:
            raise ValueError("a preset first token has no logprobs: logprobs cannot be asked for with it")
        if params.structured_outputs is not None:
            raise ValueError("a preset first token cannot be checked against a grammar (structured outputs)")

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
        if self.structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            try:
                from dsinfer.structured.manager import StructuredOutputManager
            except ImportError as exc:
                raise ValueError("structured outputs need xgrammar (pip install 'dsinfer[structured]'): "
                                 f"{exc}") from None
            self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                      self.eos_token_ids)
        return self.structured.prepare(params.structured_outputs)

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
        block_size, usable = self.config.cache.block_size, self.num_kv_blocks - 1
        needed = self._blocks_needed(len(token_ids) + max_tokens - 1)
        if needed > usable:
            asked = str(max_tokens) if params.max_tokens == max_tokens else f"{max_tokens}: the context's room"
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({asked}) needs {needed} "
                             f"KV blocks of {block_size} tokens; the KV cache has {usable} (raise "
                             "num_kv_blocks or kv_cache_memory_gb, or lower max_tokens)")
        return max_tokens


    def _blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` holds at most: all of them in a full group, its window, a prompt
        chunk, the drafts and one more in a sliding group (``kvcache.grouped_manager``)."""
        reach = self.config.scheduler.max_num_batched_tokens + self.config.speculative.num_speculative_tokens
        return max_blocks_held(self.kv_group_windows, num_tokens, self.config.cache.block_size, reach)


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
