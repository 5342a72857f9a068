"""DeepSeek-V3.2 sparse attention: MLA that attends only to the tokens its lightning indexer selects.

Per token the indexer projects a query per indexer head from the q LoRA latent (``wq_b``), one key from the layer
input (``wk``, then LayerNorm ``k_norm``) and a weight per head (``weights_proj``, in float32); the first
``qk_rope_head_dim`` features of the query and key are roped by rotating halves (transformers'
``DeepseekV32Indexer``; the MLA itself ropes interleaved pairs). Keys are cached in the pages of the MLA latent
(``IndexedMLASpec``). Each query row scores every key of its sequence up to its own position
(``ops.indexer``), keeps the ``index_topk`` best, and MLA attends to those rows of the latent cache in the
absorbed form (``ops.sparse_mla``), prefill and decode rows alike. A row that sees at most ``index_topk`` tokens
attends to all of them, as dense MLA does.

transformers skips the reference's Hadamard rotation of q and k (orthogonal: it preserves the dot products) and
its FP8 rounding of them; so does this layer, to score as transformers does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer import batch_invariant
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.core.kv_cache_spec import IndexedMLACache, IndexedMLASpec
from dsinfer.layers.fp8_linear import Fp8Config, make_linear
from dsinfer.layers.graph_pieces import attention_piece
from dsinfer.layers.linear import Linear
from dsinfer.layers.mla import MLAAttention
from dsinfer.layers.streams import SideStream
from dsinfer.ops._common import latent_values
from dsinfer.ops.indexer import indexer_topk, row_positions, store_index_keys
from dsinfer.ops.mla import rope_norm_store_mla
from dsinfer.ops.rotary import RotaryAngles, apply_rotary
from dsinfer.ops.sparse_mla import selected_slots, sparse_mla

INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")
K_NORM_EPS = 1e-6  # transformers' and the reference's LayerNorm eps for k_norm (not in the config)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in float32 (the reference's; transformers' at float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        # dummy weights: a zero bias (the name says "norm", which the dummy init would fill with ones)
        self.bias.dummy_init = lambda std, gen: self.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def check_indexer_config(cfg: dict[str, Any]) -> None:
    """Raise a ValueError naming the field for a config the indexer cannot be built from."""
    for key in INDEX_FIELDS + ("q_lora_rank",):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key} must be a positive integer for {cfg.get('architectures')} (the lightning "
                             f"indexer needs it), got {value!r}")
    if cfg["index_head_dim"] < cfg["qk_rope_head_dim"]:
        raise ValueError(f"index_head_dim={cfg['index_head_dim']} must be at least qk_rope_head_dim="
                         f"{cfg['qk_rope_head_dim']} (the indexer ropes its first qk_rope_head_dim features)")


class LightningIndexer(nn.Module):
    """The indexer's projections and its selection of the ``index_topk`` keys per query row."""

    def __init__(self, cfg: dict[str, Any], quant: Fp8Config | None):
        super().__init__()
        check_indexer_config(cfg)
        self.num_heads, self.head_dim = cfg["index_n_heads"], cfg["index_head_dim"]
        self.topk, self.rope_dim = cfg["index_topk"], cfg["qk_rope_head_dim"]
        self.wq_b = make_linear(cfg["q_lora_rank"], self.num_heads * self.head_dim, quant)
        self.wk = make_linear(cfg["hidden_size"], self.head_dim, quant)
        self.k_norm = LayerNorm(self.head_dim, K_NORM_EPS)
        self.weights_proj = Linear(cfg["hidden_size"], self.num_heads)  # unquantized in every release
        self.scale = self.head_dim**-0.5

    def project(self, hidden: torch.Tensor, q_latent: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden], q_latent [T, q_lora_rank] (normalized) -> (q [T, Hi * D], k [T, D], head
        weights [T, Hi] float32, times Hi ** -0.5 as transformers scales them)."""
        weights = F.linear(hidden.float(), self.weights_proj.weight.float()) * self.num_heads**-0.5
        return self.wq_b(q_latent), self.k_norm(self.wk(hidden)), weights

    def select(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
               batch: ForwardBatch, index_cache: torch.Tensor, cos_sin_cache: torch.Tensor,
               angles: RotaryAngles) -> torch.Tensor:
        """Rope q and k (halves), store k, score and pick -> the selected cache slots [T, K] (-1 = none)."""
        q, k = apply_rotary(positions, q.view(-1, self.num_heads, self.head_dim), k.unsqueeze(1), cos_sin_cache,
                            True, angles)
        store_index_keys(k.squeeze(1), index_cache, batch.slot_mapping)
        chosen = indexer_topk(q, weights, index_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                              self.scale, self.topk, batch.max_seq_len)
        row_seq, _ = batch.derive("row_positions", lambda: row_positions(batch.query_start_loc, batch.seq_lens,
                                                                          batch.num_tokens))
        return selected_slots(chosen, row_seq, batch.block_tables, index_cache.shape[1])


class IndexedMLAAttention(MLAAttention):
    """MLA over the indexer's selection (DeepSeek-V3.2). ``kv_cache`` is the latent cache, as for
    ``MLAAttention``; the runner binds the spec's ``IndexedMLACache`` to it, which also sets ``index_cache``."""

    def __init__(self, cfg: dict[str, Any], quant: Fp8Config | None, rope_is_neox: bool,
                 side_stream: SideStream | None = None):
        super().__init__(cfg, quant, rope_is_neox, side_stream)  # (its ``kv_cache = None`` sets index_cache)
        self.indexer = LightningIndexer(cfg, quant)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self._latent_cache

    @kv_cache.setter
    def kv_cache(self, cache: IndexedMLACache | torch.Tensor | None) -> None:
        if cache is not None and not isinstance(cache, IndexedMLACache):
            raise TypeError(f"an indexed MLA layer takes an IndexedMLACache (latent, index keys), got "
                            f"{type(cache).__name__}")
        self._latent_cache, self.index_cache = (None, None) if cache is None else cache

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> IndexedMLASpec:
        return IndexedMLASpec(block_size, self.kv_lora_rank, self.rope_dim, dtype,
                              index_head_dim=self.indexer.head_dim, index_dtype=self.indexer.k_norm.weight.dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_latent, kv_a = self._project_a(hidden)
        index_q, index_k, index_w = self.indexer.project(hidden, q_latent)
        inputs = (self.q_b_proj(q_latent), kv_a, index_q, index_k, index_w, positions)
        # rope, both cache stores, the selection and attention read the step's metadata (a graph cut)
        return self.o_proj(attention_piece(self._sparse_attention, inputs, batch))

    def _sparse_attention(self, q: torch.Tensor, kv_a: torch.Tensor, index_q: torch.Tensor,
                          index_k: torch.Tensor, index_w: torch.Tensor, positions: torch.Tensor,
                          batch: ForwardBatch) -> torch.Tensor:
        """-> the attention output [T, H * V]."""
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos_sin = self.rotary.cos_sin_cache
        angles = batch.derive(("rotary_angles", id(cos_sin)), lambda: RotaryAngles(positions, cos_sin))
        norm = self.kv_a_layernorm
        q_pe = rope_norm_store_mla(positions, q_pe, k_pe, kv_c, norm.weight, norm.eps, cos_sin, self.rotary.is_neox,
                                   self.kv_cache, batch.slot_mapping, angles=angles)
        slots = self.indexer.select(index_q, index_k, index_w, positions, batch, self.index_cache, cos_sin, angles)
        latent = sparse_mla(self._absorb(q_nope), q_pe, self.kv_cache, slots, self.scale)
        w_uv = self._kv_b()[2]
        if batch_invariant.is_enabled():  # its dispatch mode routes bmm, not the bmm into ``out`` below
            return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)
        out = latent.new_empty(latent.shape[0], self.num_heads, self.v_dim)
        return latent_values(latent, w_uv, out).flatten(1)
