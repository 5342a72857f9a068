"""Token embedding and the LM head (which may share the embedding's weight).

With tensor parallelism both split the vocabulary: rank r holds rows [r * V / tp, (r + 1) * V / tp) (its weight
loader takes them from the checkpoint's full tensor). The embedding looks up the ids in its range, zeros the
others and all-reduces; the LM head computes its slice of the logits and all-gathers them, so every rank samples
from the same full row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.distributed.state import SINGLE, ParallelState, split_evenly
from dsinfer.ops.linear import linear


def _vocab_rows(vocab_size: int, hidden_size: int, tp: ParallelState) -> nn.Parameter:
    rows = split_evenly(vocab_size, tp.tp_size, "vocab_size")
    weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
    if tp.tp_size > 1:
        def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
            if tuple(loaded.shape) != (vocab_size, hidden_size):
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                                 f"({vocab_size}, {hidden_size})")
            param.data.copy_(loaded.narrow(0, tp.tp_rank * rows, rows))

        weight.weight_loader = load
    return weight


class VocabEmbedding(nn.Module):
    """``tp``: split the vocabulary across its ranks (vLLM's VocabParallelEmbedding); default one rank."""

    quant_method = None  # a CPU quantization method (``layers.quant``) holding the weight instead

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelState = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = _vocab_rows(vocab_size, hidden_size, tp)
        self.first = tp.tp_rank * self.weight.shape[0]  # this rank's first token id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:  # one rank only (EngineArgs refuses quantization with TP)
            return self.quant_method.embed(input_ids, torch.get_default_dtype())
        if self.tp.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class LMHead(nn.Module):
    """Logits for the selected rows only (the runner passes just the rows it samples from): float32, or in the
    model dtype with ``upcast=False`` (the decode graphs: a greedy batch takes the argmax of those directly,
    the same token without a float32 copy of [batch, vocab] per step; the sampler upcasts for anything else).
    With ``tp`` of several ranks (vLLM's ParallelLMHead) each computes its vocabulary slice and they are gathered."""

    quant_method = None  # a CPU quantization method (``layers.quant``; a tied head shares the embedding's)

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 tp: ParallelState = SINGLE):
        super().__init__()
        self.tied = tied_to is not None
        self.tp = tp
        # Tied: the very same Parameter, so loading the embedding fills both.
        self.weight = tied_to.weight if self.tied else _vocab_rows(vocab_size, hidden_size, tp)

    def forward(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        if self.quant_method is not None:
            logits = self.quant_method.apply(hidden)
        else:
            logits = self.tp.all_gather(linear(hidden, self.weight), dim=-1)
        return logits.float() if upcast else logits

