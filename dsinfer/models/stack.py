"""The forward every pre-norm decoder model here shares: embed, run the layers (each takes and returns the
hidden state and the residual stream, so a layer's first norm can fold in the residual add), then the final norm
and the LM head."""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.core.forward_batch import ForwardBatch


class DecoderStack(nn.Module):
    """Base of a model with ``embed_tokens``, ``layers``, ``norm`` and ``lm_head`` modules (set by its
    ``__init__``)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, upcast)
