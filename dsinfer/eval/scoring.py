"""Log-likelihoods of token sequences from the engine's prompt logprobs (one request per sequence, one token out)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenScores:
    """Per position 1..n-1 of one sequence: the logprob of the token there given all before it, and the id the
    model ranked first at that position."""

    logprobs: np.ndarray  # float64 [n - 1]
    top_ids: np.ndarray  # int64 [n - 1]


def score_sequences(llm, sequences: list[list[int]], use_tqdm: bool = False) -> list[TokenScores]:
    """Every sequence's token logprobs through ``prompt_logprobs`` (prefix caching cannot skip them: the engine
    computes the prompt positions a request asks logprobs for)."""
    from dsinfer.engine.sampling_params import SamplingParams

    for i, ids in enumerate(sequences):
        if len(ids) < 2:
            raise ValueError(f"sequence {i} has {len(ids)} tokens: scoring needs at least 2")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in sequences], params, use_tqdm=use_tqdm)
    return [_scores(ids, out.prompt_logprobs) for ids, out in zip(sequences, outputs)]


def _scores(ids: list[int], positions) -> TokenScores:
    logprobs, top_ids = [], []
    for token, position in zip(ids[1:], positions[1:]):
        logprobs.append(position[token].logprob)
        top_ids.append(next(t for t, lp in position.items() if lp.rank == 1))
    return TokenScores(np.asarray(logprobs, dtype=np.float64), np.asarray(top_ids, dtype=np.int64))
