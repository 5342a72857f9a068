"""DeepSeek-V4's multi-token prediction (MTP) layers, as DeepSeek's reference defines ``MTPBlock``.

MTP layer k (checkpoint tensors ``mtp.{k}.*``) is a whole V4 decoder layer (hyper-connected attention and MoE, its
attention kind the one ``compress_ratios`` lists past the main layers: sliding in the published checkpoints) with
its own input projections and its own stream collapse:

    x_i      = e_proj(enorm(Emb(t_{i+1})))  +  h_proj(hnorm(H_i))     (H_i: the target's hc_mult streams at i,
                                                                      before its hc_head; e_proj's term is
                                                                      added to every stream)
    S_i      = Block_k(x_i)                                           (streams out, causal over i)
    logits_i = Head(norm(hc_head_k(S_i)))                             (P_{i+2}; Emb and Head are the model's)

The block's attention keeps its own cache, like every V4 layer: its window ring (and for a compressed kind its
compressors' rows) in the sequence's state slot, its compressed entries in blocks paged by the request's block
ids (``V4Attention.state_spec`` / ``kv_cache_spec``); whoever drafts with it binds them (``runner.mtp_proposer``).
Chained drafts feed ``S_i`` back in as the next depth's streams.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.linear import Linear
from dsinfer.layers.norm import RMSNorm
from dsinfer.models.deepseek_v4.attention import V4Attention
from dsinfer.models.deepseek_v4.config import V4Config
from dsinfer.models.deepseek_v4.hyper import HyperHead
from dsinfer.models.deepseek_v4.model import V4DecoderLayer


class V4MTPLayer(V4DecoderLayer):
    def __init__(self, cfg: V4Config, layer: int, max_position: int, embed: VocabEmbedding, head: LMHead):
        """``cfg``: the config with the MTP layers appended (``V4Config.with_mtp_layers``); ``layer``: this one's
        index there; ``embed`` / ``head``: the model's (shared, not parameters of this layer)."""
        super().__init__(cfg, layer, max_position)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)
        self.enorm, self.hnorm, self.norm = RMSNorm(d, eps), RMSNorm(d, eps), RMSNorm(d, eps)
        self.hc_head = HyperHead(d, cfg.hc_mult, cfg.hc_eps, eps)
        self._shared = (embed, head)  # a tuple: not registered as submodules (their weights are the model's)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """hidden [T, hc, D] (the target's streams, or this layer's at the previous depth), next_ids [T] (the
        token after each position) -> this layer's streams [T, hc, D]."""
        t, hc, d = hidden.shape
        embedded = self.e_proj(self.enorm(self._shared[0](next_ids)))
        streams = self.h_proj(self.hnorm(hidden.reshape(t * hc, d))).view(t, hc, d) + embedded.unsqueeze(1)
        return super().forward(streams, next_ids, positions, batch)

    def shared_head(self, streams: torch.Tensor) -> torch.Tensor:
        """This layer's streams [T, hc, D] -> draft logits [T, vocab] float32."""
        return self._shared[1](self.norm(self.hc_head(streams)))


class V4MTP(nn.Module):
    """The checkpoint's MTP layers (one in the published ones); drafting chains the first (``mtp_proposer``)."""

    def __init__(self, cfg: V4Config, max_position: int, embed: VocabEmbedding, head: LMHead):
        super().__init__()
        full = cfg.with_mtp_layers()
        self.layers = nn.ModuleList(V4MTPLayer(full, cfg.num_layers + k, max_position, embed, head)
                                    for k in range(len(cfg.mtp_layer_types)))

    def attention_layers(self) -> list[V4Attention]:
        return [layer.attn for layer in self.layers]
