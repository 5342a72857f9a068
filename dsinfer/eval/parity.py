"""``dsinfer eval parity``: the engine's prompt logprobs against transformers' on the same prompts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsinfer.eval.reference import reference_token_logprobs
from dsinfer.eval.scoring import score_sequences

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, the first humans landed on the Moon during the Apollo 11 mission.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
)


@dataclass(frozen=True)
class PromptParity:
    """One prompt's comparison over its positions 1..n-1."""

    num_tokens: int
    max_abs_diff: float  # max over positions of |our logprob - transformers'| of the prompt's next token
    mean_abs_diff: float
    greedy_agree: int  # positions where both rank the same token first (the greedy choice after that prefix)

    @property
    def num_positions(self) -> int:
        return self.num_tokens - 1


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random ids, for checkpoints without a tokenizer."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=length).tolist() for _ in range(count)]


def compare(llm, hf, prompts: list[list[int]]) -> list[PromptParity]:
    """Score every prompt with both models."""
    ours = score_sequences(llm, prompts)
    out = []
    for ids, mine in zip(prompts, ours):
        ref_logprobs, ref_top = reference_token_logprobs(hf, ids)
        diff = np.abs(mine.logprobs - ref_logprobs)
        out.append(PromptParity(len(ids), float(diff.max()), float(diff.mean()),
                                int((mine.top_ids == ref_top).sum())))
    return out


def format_table(rows: list[PromptParity]) -> str:
    """One line per prompt and the total (max of the maxima, the mean over all positions)."""
    lines = [f"{'prompt':>6} {'tokens':>6} {'max |dlogp|':>12} {'mean |dlogp|':>12} {'greedy agree':>14}"]
    for i, r in enumerate(rows):
        lines.append(f"{i:>6} {r.num_tokens:>6} {r.max_abs_diff:>12.3e} {r.mean_abs_diff:>12.3e} "
                     f"{r.greedy_agree:>6}/{r.num_positions:<7}")
    positions = sum(r.num_positions for r in rows)
    mean = sum(r.mean_abs_diff * r.num_positions for r in rows) / positions
    agree = sum(r.greedy_agree for r in rows)
    lines.append(f"{'all':>6} {sum(r.num_tokens for r in rows):>6} {max(r.max_abs_diff for r in rows):>12.3e} "
                 f"{mean:>12.3e} {agree:>6}/{positions:<7}")
    return "\n".join(lines)
