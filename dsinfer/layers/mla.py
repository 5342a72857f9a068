"""Multi-head latent attention (DeepSeek-V2/V3) with a latent-only paged KV cache.

Per token the query comes from ``q_proj`` (no q LoRA) or ``q_b_proj(RMSNorm(q_a_proj(x)))``; the KV path is
``kv_a_proj_with_mqa(x) = [c | k_pe]``: a latent ``c`` (kv_lora_rank, RMS-normalized) and one rope key shared
by all heads. Only ``[c | k_pe]`` is cached (``MLASpec``). Decode rows attend in the absorbed form (W_UK
folded into the query, W_UV applied to the attended latent); rows of sequences with several new tokens
(prefill, chunked prefill, prefill after a prefix-cache hit) expand K/V for their whole context from the
cached latent. In deterministic mode every row takes the absorbed form by one fixed-order recipe
(``batch_invariant.mla``), so a token's result does not depend on how its step was scheduled.

Per decode step a layer runs: one GEMM for q (or q_a) and kv_a together (``fused_qkv_a_proj``), one kernel for
rope + latent norm + cache store (``ops.mla.rope_norm_store_mla``) and the W_UK bmm (at a few tokens both in
that kernel), the decode kernel (plus its split reduction), the W_UV bmm written straight into o_proj's input
layout, and o_proj.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dsinfer import batch_invariant
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.core.kv_cache_spec import MLASpec
from dsinfer.distributed.state import SINGLE, ParallelState, split_evenly
from dsinfer.layers.fp8_linear import Fp8BlockLinear, Fp8Config, make_linear
from dsinfer.layers.graph_pieces import attention_piece
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RotaryEmbedding, rope_parameters_of
from dsinfer.layers.streams import SideStream, in_graphs
from dsinfer.ops._common import PackedContexts
from dsinfer.ops.mla import absorb_query, mla_decode_uv, mla_prefill, rope_norm_store_mla
from dsinfer.ops.rotary import RotaryAngles

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps
# decode steps of up to this many tokens x heads absorb W_UK in the rope / norm / store launch
# (``rope_norm_store_mla`` with ``absorb``: a program per head and 128 latent columns, each reading its W_UK tile
# once per token); larger ones run the batched GEMM on the side stream, which reads W_UK once for all tokens. H200,
# decode graph (session 19): V2-Lite (16 heads) 1 / 4 tokens 2.238 -> 2.159 / 4.241 -> 4.204 ms; V3 (128 heads,
# 5 layers, FP8) 1 / 4 tokens 1.520 -> 1.554 / 2.603 -> 2.616 ms, so not there
FUSED_ABSORB_MAX_HEAD_ROWS = 64


@dataclass
class MLARows:
    """A sub-batch of sequences: their token rows in the flat batch and their attention metadata."""

    rows: torch.Tensor | None  # [T_sub] row indices; None = every row of the batch
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    contexts: PackedContexts | None = None  # prefill rows: their contexts packed for ``mla_prefill`` (lazily)


@dataclass
class MLAMetadata:
    """The batch split once per step (``of``, shared by every MLA layer): one-token rows and multi-token rows."""

    decode: MLARows | None
    prefill: MLARows | None
    max_seq_len: int | None = None  # host-side bound on seq_lens (sizes the decode kernel's split-KV grid)
    invariant: MLARows | None = None  # deterministic mode: every row, one recipe (decode / prefill are None)

    @classmethod
    def of(cls, batch: ForwardBatch, block_size: int) -> MLAMetadata:
        """The batch's metadata: built by the first MLA layer of a step, shared by the others (every MLA layer
        of a model has cache blocks of ``block_size`` tokens)."""
        return batch.derive(("mla", block_size), lambda: cls.build(batch, block_size))

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int) -> MLAMetadata:
        everything = MLARows(None, batch.block_tables, batch.query_start_loc, batch.seq_lens)
        if batch_invariant.is_enabled():
            return cls(None, None, batch.max_seq_len, invariant=everything)
        if batch.max_query_len == 1:
            return cls(everything, None, batch.max_seq_len)
        q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
        is_decode = q_lens == 1
        if not bool(is_decode.any()):
            prefill = MLARows(None, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                              PackedContexts(batch.block_tables, batch.seq_lens, block_size))
            return cls(None, prefill, batch.max_seq_len)
        prefill = cls._subset(batch, ~is_decode, q_lens)
        prefill.contexts = PackedContexts(prefill.block_tables, prefill.seq_lens, block_size)
        return cls(cls._subset(batch, is_decode, q_lens), prefill, batch.max_seq_len)

    @staticmethod
    def _subset(batch: ForwardBatch, keep: torch.Tensor, q_lens: torch.Tensor) -> MLARows:
        seqs = keep.nonzero().squeeze(1)
        rows = keep.repeat_interleave(q_lens.long()).nonzero().squeeze(1)
        cu = torch.zeros(seqs.numel() + 1, dtype=batch.query_start_loc.dtype, device=seqs.device)
        torch.cumsum(q_lens[seqs], 0, out=cu[1:])
        return MLARows(rows, batch.block_tables[seqs], cu, batch.seq_lens[seqs])


def yarn_softmax_scale(head_dim: int, rope: dict[str, Any]) -> float:
    """head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN (DeepSeek's attention temperature)."""
    scale = head_dim**-0.5
    mscale_all_dim = rope.get("mscale_all_dim")
    factor = rope.get("factor") or 1.0
    if rope["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def fuses_q_kv_a(cfg: dict[str, Any]) -> bool:
    """Whether q_a_proj (q LoRA) or q_proj (none) and kv_a_proj_with_mqa load into one ``fused_qkv_a_proj``
    (shards 0 and 1): always, except where only kv_a_proj_with_mqa has a bias (attention_bias, no q LoRA)."""
    return bool(cfg.get("q_lora_rank")) or not cfg.get("attention_bias")


class MLAAttention(nn.Module):
    """One MLA layer: projections, rope, the latent cache (``kv_cache``, bound by the runner), attention."""

    def __init__(self, cfg: dict[str, Any], quant: Fp8Config | None, rope_is_neox: bool,
                 side_stream: SideStream | None = None, tp: ParallelState = SINGLE):
        """``side_stream``: the model's, to overlap rope and the cache store with the query absorption in CUDA
        graphs (None: one stream, ``KernelConfig.side_stream`` off). ``tp``: the heads split across its ranks
        (q / q_b_proj and kv_b_proj by rows, o_proj by columns); the latent and its cache are every rank's."""
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = split_evenly(cfg["num_attention_heads"], tp.tp_size, "num_attention_heads")  # this rank's
        heads = cfg["num_attention_heads"]
        self.q_lora_rank, self.kv_lora_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        self.nope_dim, self.rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim = cfg["v_head_dim"]
        bias = bool(cfg.get("attention_bias"))
        q_out = heads * (self.nope_dim + self.rope_dim)
        kv_a = self.kv_lora_rank + self.rope_dim
        # the two projections of the layer input, q_a_proj (or q_proj) and kv_a_proj_with_mqa, run as one GEMM
        # (the checkpoint's tensors load into its two row ranges: see ``fuses_q_kv_a``); q_proj's rows are split by
        # heads, the latents are every rank's
        q_first = self.q_lora_rank or q_out
        self.fused_qkv_a_proj = self.q_proj = None
        if fuses_q_kv_a(cfg):
            split = None if self.q_lora_rank else "column"
            self.fused_qkv_a_proj = make_linear(hidden, [q_first, kv_a], quant, bias=bias, tp=tp, split=split,
                                                shard_parts={1: (1, 0)}, what="num_attention_heads")
        else:  # a bias on kv_a_proj_with_mqa but none on q_proj: kept apart
            self.q_proj = make_linear(hidden, q_out, quant, tp=tp, split="column", what="num_attention_heads")
            self.kv_a_proj_with_mqa = make_linear(hidden, kv_a, quant, bias=bias)
        local_q = self.num_heads * (self.nope_dim + self.rope_dim)
        self.q_split = [self.q_lora_rank or local_q, kv_a]
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = make_linear(self.q_lora_rank, q_out, quant, tp=tp, split="column",
                                        what="num_attention_heads")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = make_linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), quant, tp=tp,
                                     split="column", what="num_attention_heads")
        self.o_proj = make_linear(heads * self.v_dim, hidden, quant, bias=bias, tp=tp, split="row",
                                  what="num_attention_heads * v_head_dim")
        rope = rope_parameters_of(cfg)
        self.rotary = RotaryEmbedding(
            self.rope_dim, cfg.get("max_position_embeddings", 4096), rope, rope_is_neox
        )
        self.scale = yarn_softmax_scale(self.nope_dim + self.rope_dim, rope)
        self.kv_cache: torch.Tensor | None = None
        self._kv_b_dense: torch.Tensor | None = None  # an FP8 kv_b_proj dequantized once (see below)
        self._kv_b_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see _split_kv_b
        self.side_stream = side_stream  # rope + cache store beside the query absorption, in graphs

    def process_weights_after_loading(self) -> None:
        """Attention multiplies by kv_b_proj's weight directly (absorbed into the query, expanding the latent),
        so an FP8 one is dequantized once here rather than on every forward; the per-head views are built once."""
        if isinstance(self.kv_b_proj, Fp8BlockLinear):
            self._kv_b_dense = self.kv_b_proj.dequantized_weight()
        self._kv_b_views = self._split_kv_b()

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head, w_kv_b [H, N + V, R] (what the prefill expansion takes), and two views of
        it taken without a copy (each head's block is contiguous; cuBLAS takes a strided batch): W_UK [H, N, R]
        (absorbs q_nope) and W_UV [H, V, R] (applies the attended latent, ``ops.mla.mla_decode_uv``)."""
        weight = self.kv_b_proj.weight if self._kv_b_dense is None else self._kv_b_dense
        w_kv_b = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w_kv_b, w_kv_b[:, : self.nope_dim], w_kv_b[:, self.nope_dim :]

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        views = self._kv_b_views
        # rebuilt when post-load processing has not run (a bare module) or the weight was swapped since
        if views is None or (self._kv_b_dense is None and views[0].data_ptr() != self.kv_b_proj.weight.data_ptr()):
            views = self._kv_b_views = self._split_kv_b()
        return views

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MLASpec:
        return MLASpec(block_size, self.kv_lora_rank, self.rope_dim, dtype)

    def _project_a(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the normalized q LoRA latent [T, q_lora_rank], or q [T, H * (N + P)] without q LoRA; kv_a
        [T, R + P]), kv_a possibly a column slice of one GEMM's output."""
        if self.fused_qkv_a_proj is not None:
            q, kv_a = self.fused_qkv_a_proj(hidden).split(self.q_split, dim=-1)
        else:
            q, kv_a = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        return (self.q_a_layernorm(q) if self.q_lora_rank else q), kv_a

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [T, H * (N + P)], kv_a [T, R + P]), both possibly column slices of one GEMM's output."""
        q, kv_a = self._project_a(hidden)
        return (self.q_b_proj(q) if self.q_lora_rank else q), kv_a

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, kv_a = self._project(hidden)
        # rope, the cache store and attention read the step's metadata: a prefill CUDA graph is cut around them
        out = attention_piece(self._attention, (q, kv_a, positions), batch)
        return self.o_proj(out)

    def _attention(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                   batch: ForwardBatch) -> torch.Tensor:
        """q [T, H * (N + P)], kv_a [T, R + P] -> the attention output [T, H * V]."""
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        norm, rotary = self.kv_a_layernorm, self.rotary

        # the rope's cos/sin at this step's positions, for the torch path (gathered on first use, once per step)
        angles = batch.derive(("rotary_angles", id(rotary.cos_sin_cache)),
                              lambda: RotaryAngles(positions, rotary.cos_sin_cache))

        def rope_and_store(q_pe: torch.Tensor, absorb=None):
            return rope_norm_store_mla(positions, q_pe, k_pe, kv_c, norm.weight, norm.eps, rotary.cos_sin_cache,
                                       rotary.is_neox, self.kv_cache, batch.slot_mapping, absorb=absorb,
                                       angles=angles)

        meta = MLAMetadata.of(batch, self.kv_cache.shape[1])
        if meta.decode is not None and meta.decode.rows is None:  # a decode step (one token per sequence)
            out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
            if q.shape[0] * self.num_heads <= FUSED_ABSORB_MAX_HEAD_ROWS:
                # rope, the latent norm, the cache store and the W_UK absorption in one launch
                q_absorbed, q_pe = rope_and_store(q_pe, absorb=(q_nope, self._kv_b()[1]))
                return self._decode(q_absorbed, q_pe, meta.decode, meta.max_seq_len, out).flatten(1)
            if self.side_stream is not None and q.is_cuda and in_graphs(batch):
                # in a CUDA graph: rope, the latent norm and the cache store on the side stream while this one
                # absorbs W_UK into the query (a batched GEMM); the decode kernel waits for both
                join = self.side_stream.run_beside(rope_and_store, q_pe)
                q_absorbed = self._absorb(q_nope)
                return self._decode(q_absorbed, join(), meta.decode, meta.max_seq_len, out).flatten(1)
        return self.attend(q_nope, rope_and_store(q_pe), meta).flatten(1)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, N] -> [T, H, R] (``ops.mla.absorb_query`` with this layer's W_UK)."""
        return absorb_query(q_nope, self._kv_b()[1])

    def _decode(self, q_absorbed: torch.Tensor, q_pe: torch.Tensor, d: MLARows, max_seq_len: int | None,
                out: torch.Tensor) -> torch.Tensor:
        """Attention of one-token rows over the latent cache, then W_UV, written into ``out`` [T, H, V]."""
        return mla_decode_uv(q_absorbed, q_pe, self.kv_cache, d.block_tables, d.query_start_loc, d.seq_lens,
                             self.scale, self._kv_b()[2], out=out, max_seq_len=max_seq_len)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: MLAMetadata) -> torch.Tensor:
        """q_nope [T, H, N], q_pe [T, H, P] (roped) -> [T, H, V] (contiguous)."""
        w_kv_b = self._kv_b()[0]
        if meta.invariant is not None:
            from dsinfer.batch_invariant.mla import mla_attention_invariant

            i = meta.invariant
            return mla_attention_invariant(q_nope, q_pe, self.kv_cache, i.block_tables, i.query_start_loc,
                                           i.seq_lens, w_kv_b, self.scale)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        if meta.decode is not None:
            d = meta.decode
            qn, qp = (q_nope, q_pe) if d.rows is None else (q_nope[d.rows], q_pe[d.rows])
            o = out if d.rows is None else out.new_empty(qn.shape[0], self.num_heads, self.v_dim)
            self._decode(self._absorb(qn), qp, d, meta.max_seq_len, o)
            if d.rows is None:
                return out
            out[d.rows] = o
        if meta.prefill is not None:
            p = meta.prefill
            qn, qp = (q_nope, q_pe) if p.rows is None else (q_nope[p.rows], q_pe[p.rows])
            o = mla_prefill(qn, qp, self.kv_cache, p.block_tables, p.query_start_loc, p.seq_lens, w_kv_b, self.scale,
                            p.contexts)
            if p.rows is None:
                return o
            out[p.rows] = o
        return out
