"""``dsinfer eval ppl``: perplexity of a token sequence with sliding windows, as transformers' perplexity recipe.

Windows of at most ``max_length`` tokens start every ``stride`` tokens; each window scores only the tokens the
previous window did not reach (with the window's earlier tokens as context), so every token after the first is
scored exactly once, with up to ``max_length - stride`` tokens of context before the window's first scored one."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsinfer.eval.scoring import score_sequences


@dataclass(frozen=True)
class Window:
    begin: int  # the window is ids[begin:end]
    end: int
    first_scored: int  # tokens at positions first_scored..end-1 are scored (never position 0)


@dataclass(frozen=True)
class Perplexity:
    nll_sum: float  # minus the sum of the scored tokens' logprobs (nats)
    num_tokens: int  # tokens scored

    @property
    def value(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens)


def windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    """transformers' loop: ``for begin in range(0, n, stride)`` up to the window that reaches the end."""
    if not 0 < stride <= max_length:
        raise ValueError(f"--stride must be in 1..--max-length ({max_length}), got {stride}")
    if num_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def perplexity(llm, ids: list[int], max_length: int, stride: int, use_tqdm: bool = False) -> Perplexity:
    """The engine's perplexity of ``ids`` (one prompt-logprobs request per window, batched)."""
    spans = windows(len(ids), max_length, stride)
    scores = score_sequences(llm, [ids[w.begin:w.end] for w in spans], use_tqdm=use_tqdm)
    nll, count = 0.0, 0
    for w, s in zip(spans, scores):
        scored = s.logprobs[w.first_scored - w.begin - 1:]  # logprobs[j] is position begin + 1 + j
        nll -= float(scored.sum())
        count += len(scored)
    return Perplexity(nll, count)


def transformers_perplexity(hf, ids: list[int], max_length: int, stride: int) -> float:
    """transformers' recipe (docs: "Perplexity of fixed-length models"), as written there: each window's mean loss
    weighted by its number of labels less one."""
    import torch

    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    encodings = torch.tensor([ids])
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        input_ids = encodings[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target_ids).loss
        num_loss_tokens = int((target_ids != -100).sum()) - target_ids.size(0)
        nll_sum += float(loss) * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens)
