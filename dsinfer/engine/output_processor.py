"""Per-request output state: detokenized text, logprob objects, and the RequestOutput a user sees.

A user request with ``n > 1`` runs as n engine requests (children); ``ParentRequest`` gathers them into one
RequestOutput whose ``outputs[i]`` is child i. Streamed (DELTA) outputs carry only the children with something
to say: a child that finished before its siblings is reported once, with its finish_reason, as in vLLM; each
completion carries its ``index``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dsinfer.core.outputs import TokenLogprobs
from dsinfer.core.request import FINISHED_STATUSES, Request
from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from dsinfer.tokenizer import Tokenizer


class LogprobDecoder:
    """Turns TokenLogprobs into vLLM-shaped {token id: Logprob} dicts, decoding each candidate token."""

    def __init__(self, tokenizer: Tokenizer | None):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def _decode(self, token_id: int) -> str | None:
        if self._tok is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def position(self, data: TokenLogprobs) -> PositionLogprobs:
        out: PositionLogprobs = {}
        for i, (tid, lp) in enumerate(zip(data.token_ids, data.logprobs)):
            if tid not in out:
                out[tid] = Logprob(lp, data.rank if i == 0 else i, self._decode(tid))
        return out


@dataclass
class ChildState:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text_sent_tokens: int = 0  # token ids already returned as deltas
    logprobs_sent: int = 0
    finish_sent: bool = False  # DELTA: its finish was reported (it is left out of later outputs)
    # its sampling reads its latest outputs on the host (penalties, grammars, long bad words): the engine steps
    # synchronously while it runs
    needs_host_tokens: bool = False


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    children: list[ChildState] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.request.status in FINISHED_STATUSES for c in self.children)

    def make_output(self, finished: bool | None = None) -> RequestOutput | None:
        """The output to return now, by the request's output kind (None: nothing to say yet). ``finished``: the
        caller's ``self.finished``, when it has it."""
        if finished is None:
            finished = self.finished
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        self.mark_finished_time()  # the final output carries it (it is made before the parent is retired)
        first = self.children[0].request
        live = self.children if kind != RequestOutputKind.DELTA else [c for c in self.children if not c.finish_sent]
        completions = [self._completion(c, kind) for c in live]
        metrics = RequestMetrics(self.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 self.finished_time, max(first.num_cached_tokens, 0))
        prompt_lp = first.prompt_logprobs if first.needs_prompt_logprobs else None
        if prompt_lp is not None and not self.params.detokenize:
            prompt_lp = _undecoded(prompt_lp)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_lp, completions,
                             finished, metrics, max(first.num_cached_tokens, 0))

    def _completion(self, child: ChildState, kind: RequestOutputKind) -> CompletionOutput:
        req = child.request
        done = req.is_finished
        status = req.status.value if done else None
        if kind == RequestOutputKind.DELTA:
            text = child.detokenizer.delta(done) if child.detokenizer else ""
            token_ids = req.output_token_ids[child.text_sent_tokens:]
            logprobs = req.logprobs[child.logprobs_sent:] if req.params.logprobs is not None else None
            child.text_sent_tokens, child.logprobs_sent = req.num_output_tokens, len(req.logprobs)
            child.finish_sent = done
        else:
            text = child.detokenizer.visible_text(done) if child.detokenizer else ""
            token_ids = list(req.output_token_ids)
            logprobs = list(req.logprobs) if req.params.logprobs is not None else None
        if not req.params.detokenize:  # vLLM: ids only; the detokenizer still runs, but nothing of it is shown
            text = ""
            logprobs = _undecoded(logprobs) if logprobs is not None else None
        cumulative = req.cumulative_logprob if req.params.logprobs is not None else None
        return CompletionOutput(req.index, text, token_ids, cumulative, logprobs, status, req.stop_reason)

    def mark_finished_time(self) -> None:
        if self.finished and self.finished_time is None:
            self.finished_time = time.monotonic()


def _undecoded(positions: list[PositionLogprobs | None]) -> list[PositionLogprobs | None]:
    """Copies without decoded_token (the engine decodes every candidate for all requests alike)."""
    return [None if pos is None else {tid: Logprob(lp.logprob, lp.rank) for tid, lp in pos.items()}
            for pos in positions]
