"""Seeded Gumbel-max sampling of one token per row, with greedy rows (temperature 0) in the same call.

``gumbel_argmax(logits, seeds, positions, temperature)``: row b takes ``argmax(logits[b])`` when
``temperature[b] == 0``, else ``argmax(logits[b] / temperature[b] + gumbel(seeds[b], positions[b], token))``
with the counter-based noise of ``dsinfer.ops.noise``, so a seeded request draws the same token in any
batch and on either path. Masked tokens arrive as ``-inf`` logits and are never picked (unless the whole row
is masked: then token 0). Ties go to the lowest token id, as ``torch.argmax``.
"""

from __future__ import annotations

import torch

from dsinfer.ops.dispatch import use_triton
from dsinfer.ops.noise import gumbel_noise


def gumbel_argmax_ref(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """logits [B, V] float32, seeds/positions int64 [B], temperature float32 [B] -> token ids int64 [B]."""
    logits = logits.float()
    sample = temperature > 0
    temp = torch.where(sample, temperature.float(), torch.ones_like(temperature, dtype=torch.float32))
    scores = logits / temp.unsqueeze(1) + gumbel_noise(seeds, positions, logits.shape[1])
    return torch.where(sample, scores.argmax(-1), logits.argmax(-1))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [B, V] logits (the first maximum), int64 [B]: a batch that is greedy throughout.
    The Triton walk skips NaN logits where ``torch.argmax`` returns the first NaN: a model whose logits hold NaN
    gives no meaningful token either way."""
    if use_triton(logits):
        from dsinfer.ops.triton.sampling import argmax_triton

        return argmax_triton(logits)
    return logits.argmax(-1)


def gumbel_argmax(
    logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    if use_triton(logits):
        from dsinfer.ops.triton.sampling import gumbel_argmax_triton

        return gumbel_argmax_triton(logits, seeds, positions, temperature)
    return gumbel_argmax_ref(logits, seeds, positions, temperature)
