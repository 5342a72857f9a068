"""StructuredOutputManager: the engine's one entry point to structured outputs.

- ``prepare(params)`` (at add_request, caller's thread): parse and validate the constraint (ValueError when
  invalid) and start compiling it in the thread pool unless the byte-bounded cache has it. Requests with the
  same constraint share one compilation.
- The scheduler leaves a request waiting while ``request.grammar.ready`` is false; others proceed.
- ``bitmask(scheduled)``: one packed int32 row per scheduled item that samples (scheduled order), after syncing
  each matcher to its request's output tokens; None when no sampling row is constrained.
- ``advance(request)`` after a token is appended: "continue", "complete" (the token was a stop token the grammar
  accepted: the output is finished) or "rejected". As in vLLM, a grammar that is complete does not end the request
  itself: its mask then allows only the stop tokens (EOS), the model samples one, and that EOS id ends
  ``token_ids`` (with its logprob) like any EOS.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dsinfer import envs
from dsinfer.structured import backend
from dsinfer.structured.cache import ByteBoundedLRU
from dsinfer.structured.matcher import GrammarRejected, RequestGrammar
from dsinfer.structured.spec import StructuredSpec, parse_structured_outputs
from dsinfer.tokenizer import Tokenizer

logger = logging.getLogger("dsinfer")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int] | frozenset[int],
                 cache_bytes: int | None = None, compile_threads: int | None = None):
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        threads = max(1, compile_threads or envs.STRUCTURED_COMPILE_THREADS.get())
        info = backend.tokenizer_info(tokenizer, vocab_size, sorted(self.stop_token_ids))
        self._compiler = backend.GrammarCompiler(info, max_threads=threads)
        limit = cache_bytes if cache_bytes is not None else int(envs.STRUCTURED_CACHE_MB.get() * (1 << 20))
        self.cache: ByteBoundedLRU[Any] = ByteBoundedLRU(limit, backend.compiled_size)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dsinfer-grammar")
        self._inflight: dict[str, Future] = {}
        self._compiling: list[Any] = []  # requests whose grammar was not compiled when they arrived

    # ---- requests ----------
    def prepare(self, raw: dict[str, Any]) -> tuple[StructuredSpec, Future]:
        """Validate ``raw`` and return (spec, future of its compiled grammar); ValueError when invalid."""
        spec = parse_structured_outputs(raw)
        key = spec.key
        compiled = self.cache.get(key)
        if compiled is not None:
            return spec, _done(compiled)
        future = self._inflight.get(key)
        if future is None:
            grammar = backend.build_grammar(spec)  # parse errors surface here, to the caller
            future = self._pool.submit(self._compile, key, grammar)
            self._inflight[key] = future
            future.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))
        return spec, future

    def _compile(self, key: str, grammar: Any) -> Any:
        compiled = self._compiler.compile(grammar)
        self.cache.put(key, compiled)
        return compiled

    def request_grammar(self, request: Any, spec: StructuredSpec, future: Future) -> RequestGrammar:
        """A fresh matcher state for one engine request (n > 1: one per sample), tracked until compiled."""
        grammar = RequestGrammar(spec, future)
        if not future.done() or future.exception() is not None:
            self._compiling.append(request)
        return grammar

    def take_failed(self) -> list[tuple[Any, BaseException]]:
        """Requests whose grammar failed to compile since the last call (the engine finishes them)."""
        if not self._compiling:
            return []
        failed = [(r, r.grammar.error) for r in self._compiling if r.grammar.ready and r.grammar.error]
        self._compiling = [r for r in self._compiling if not r.grammar.ready and not r.is_finished]
        return failed

    # ---- each step ----------
    def bitmask(self, scheduled: list[Any]) -> torch.Tensor | None:
        """One row per sampled position in batch order: a sampling request's 1 + (its drafts) rows, row i the
        grammar's mask after its drafts[:i] (the matcher is left at the request's outputs); -1 rows: no grammar."""
        items = [s for s in scheduled if s.samples]
        if not any(s.request.grammar is not None for s in items):
            return None
        num_rows = sum(1 + len(s.draft_token_ids) for s in items)
        mask = torch.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        row = 0
        for item in items:
            request, drafts = item.request, item.draft_token_ids
            if request.grammar is not None:
                try:
                    request.grammar.sync(request.output_token_ids)
                    request.grammar.fill_draft_bitmasks(mask, row, drafts)
                except GrammarRejected:
                    logger.warning("request %s: output left its grammar; unconstrained from here",
                                   request.request_id)
            row += 1 + len(drafts)
        return mask

    def valid_drafts(self, request: Any, draft_token_ids: list[int]) -> int:
        """How many leading drafts the request's grammar accepts after its outputs (the matcher is unchanged);
        0 while it compiles or after its output left it."""
        grammar: RequestGrammar = request.grammar
        if not grammar.ready or grammar.error is not None:
            return 0
        try:
            grammar.sync(request.output_token_ids)
            return grammar.check_drafts(draft_token_ids)
        except GrammarRejected:
            return 0

    def advance(self, request: Any) -> str:
        grammar: RequestGrammar = request.grammar
        try:
            grammar.sync(request.output_token_ids)
        except GrammarRejected as exc:
            logger.warning("request %s: %s", request.request_id, exc)
            return "rejected"
        if grammar.is_terminated:
            return "complete"
        return "continue"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
