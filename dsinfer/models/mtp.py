"""DeepSeek-V3 multi-token prediction (MTP) draft module.

Layer k of the checkpoint's ``num_nextn_predict_layers`` (stored as ``model.layers.{num_hidden_layers + k}``)
implements the report's equations (DeepSeek-V3 technical report, section 2.2):

    h'_i   = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])    (the report's M_k [RMSNorm(h); RMSNorm(Emb)];
                                                           eh_proj in checkpoints: embedding half first)
    h_i^k  = TRM_k(h'_i)                                   (one MLA + MoE decoder block, causal over i)
    logits = shared_head.head(shared_head.norm(h_i^k))      (P_{i+1+k})

``h_i`` is the main model's last hidden state at position i (what ``compute_logits`` takes) and ``t_{i+1}``
the token after position i. Each MTP layer has its own latent KV cache (``attention_layers()``), sized and
bound by whoever runs drafts (speculative decoding); the main model's cache does not include it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsinfer.config import KernelConfig
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.distributed.state import SINGLE, ParallelState
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.fp8_linear import Fp8Config
from dsinfer.layers.linear import Linear
from dsinfer.layers.mla import MLAAttention
from dsinfer.layers.moe import ExpertSlots
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.streams import SideStream
from dsinfer.models.deepseek.blocks import DeepseekDecoderLayer


class SharedHead(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: ParallelState = SINGLE):
        super().__init__()
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.head = LMHead(cfg["vocab_size"], cfg["hidden_size"], tp=tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class DeepseekMTPLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, quant: Fp8Config | None, variant: dict[str, Any],
                 kernel: KernelConfig | None = None, side_stream: SideStream | None = None,
                 tp: ParallelState = SINGLE, expert_slots: ExpertSlots | None = None):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], hidden, tp)
        self.enorm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.hnorm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.eh_proj = Linear(2 * hidden, hidden)  # kept unquantized in FP8 checkpoints
        self.block = DeepseekDecoderLayer(cfg, layer_idx, quant, variant, kernel, side_stream, tp, expert_slots)
        self.shared_head = SharedHead(cfg, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)), dim=-1))
        x, residual = self.block(positions, x, None, batch)
        return x + residual


class DeepseekMTP(nn.Module):
    """The model's MTP layers (usually one); ``forward`` runs one of them."""

    def __init__(self, cfg: dict[str, Any], quant: Fp8Config | None, variant: dict[str, Any],
                 kernel: KernelConfig | None = None, side_stream: SideStream | None = None,
                 tp: ParallelState = SINGLE, expert_slots: ExpertSlots | None = None):
        """``kernel`` / ``side_stream`` / ``tp`` / ``expert_slots``: the main model's (None: the defaults / one
        stream; one rank; no redundant experts)."""
        super().__init__()
        first = cfg["num_hidden_layers"]
        self.layers = nn.ModuleList(
            DeepseekMTPLayer(cfg, first + k, quant, variant, kernel, side_stream, tp, expert_slots)
            for k in range(cfg["num_nextn_predict_layers"])
        )

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.block.self_attn for layer in self.layers]

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        depth: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, D] (main model's last hidden states), next_ids [T] (token after each position)
        -> (draft logits [T, vocab] float32, this layer's hidden states [T, D] for the next depth)."""
        layer = self.layers[depth]
        out = layer(hidden, next_ids, positions, batch)
        return layer.shared_head(out), out
