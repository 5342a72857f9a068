"""The lightning indexer of CSA layers: which compressed entries each query attends to.

It keeps its own compressed keys (a compressor of ``index_head_dim`` channels over the same overlapping windows)
and scores query t against entry s as ``sum_h w_{t,h} ReLU(q_{t,h} . k_s) / sqrt(index_head_dim)``, with
``q = wq_b(q_lora)`` (roped at t) and ``w = weights_proj(x) / sqrt(index_n_heads)``; each query keeps the
``index_topk`` best of the entries it may see (s < (t + 1) // rate).
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.layers.linear import Linear
from dsinfer.models.deepseek_v4.compressor import Compressor
from dsinfer.models.deepseek_v4.rope import V4Rope, apply_rope


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, num_heads: int, head_dim: int, topk: int, rate: int,
                 rope: V4Rope, eps: float):
        super().__init__()
        self.num_heads, self.head_dim, self.topk, self.rate = num_heads, head_dim, topk, rate
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim)
        self.weights_proj = Linear(hidden, num_heads)
        self.compressor = Compressor(hidden, head_dim, rate, True, rope, eps)
        self.rope = rope

    def queries(self, q_lora: torch.Tensor, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's indexer queries [T, heads, head_dim] (roped) and head weights [T, heads]."""
        q = self.wq_b(q_lora).view(-1, self.num_heads, self.head_dim)
        cos, sin = self.rope.angles(positions)
        return apply_rope(q, cos, sin), self.weights_proj(x).float() * self.num_heads ** -0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
        """Which of one sequence's entries each of its queries attends to: bool [n, m], from its queries q
        [n, heads, dim], weights [n, heads], its compressed keys [m, dim] and query positions [n]."""
        scores = torch.relu(torch.einsum("nhd,md->nhm", q.float(), keys.float())) * self.head_dim ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        visible = torch.arange(keys.shape[0], device=q.device) < ((positions + 1) // self.rate).unsqueeze(-1)
        scores = scores.masked_fill(~visible, float("-inf"))
        picked = scores.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, picked, True)
        return chosen & visible
