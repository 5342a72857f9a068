"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.ops.linear import linear


class VocabEmbedding(nn.Module):
    quant_method = None  # a CPU quantization method (``layers.quant``) holding the weight instead

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(input_ids, torch.get_default_dtype())
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits for the selected rows only (the runner passes just the rows it samples from): float32, or in the
    model dtype with ``upcast=False`` (the decode graphs: a greedy batch takes the argmax of those directly,
    the same token without a float32 copy of [batch, vocab] per step; the sampler upcasts for anything else)."""

    quant_method = None  # a CPU quantization method (``layers.quant``; a tied head shares the embedding's)

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied = tied_to is not None
        # Tied: the very same Parameter, so loading the embedding fills both.
        self.weight = tied_to.weight if self.tied else nn.Parameter(
            torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        if self.quant_method is not None:
            logits = self.quant_method.apply(hidden)
        else:
            logits = linear(hidden, self.weight)
        return logits.float() if upcast else logits
