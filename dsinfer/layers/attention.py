"""Paged attention layer: stores this step's K/V in its cache, then attends over the cached context.

The runner binds ``kv_cache`` (shaped by the layer's KVCacheSpec) after sizing the cache; the forward batch is
passed explicitly. ``k_scale`` / ``v_scale`` are the layer's FP8 KV-cache scales (``ops.kv_cache``): 1.0, as in
vLLM, unless the checkpoint carries them (``load_kv_scale``); a cache in the model's dtype ignores them.
``sinks`` (GPT-OSS): a learned logit per query head that joins every row's softmax denominator (``ops.attention``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dsinfer import ops
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from dsinfer.distributed.state import SINGLE, ParallelState
from dsinfer.layers.graph_pieces import attention_piece
from dsinfer.layers.rotary import RotaryEmbedding
from dsinfer.ops.attention import AttentionPlan
from dsinfer.ops.kv_cache import StoredRows
from dsinfer.ops.rotary import RotaryAngles


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, sinks: bool = False, tp: ParallelState = SINGLE):
        """``num_heads`` / ``num_kv_heads``: this rank's (with tensor parallelism, its slice of the heads: the
        KV cache holds only those); ``tp``: the split, for the sinks' loader."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window = scale, sliding_window
        self.kv_cache: torch.Tensor | None = None
        self.k_scale, self.v_scale = 1.0, 1.0
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        if self.sinks is not None and tp.tp_size > 1:
            self.sinks.weight_loader = lambda param, loaded: param.data.copy_(
                loaded.narrow(0, tp.tp_rank * num_heads, num_heads))
        self.kv_group = 0  # the KV cache group whose block table it reads (the runner sets it)
        # rope + store and decode steps by the C++ kernels (ops.rotary, ops.attention; set by layers.quant)
        self.native_cpu = False

    def load_kv_scale(self, which: str, value: torch.Tensor) -> None:
        """A checkpoint's ``k_scale`` / ``v_scale`` (or ``kv_scale``, both): one positive finite number."""
        if value.numel() != 1:
            raise ValueError(f"KV-cache {which} must be a single value (per-tensor), got shape {tuple(value.shape)}")
        scale = float(value.float())
        if not 0 < scale < float("inf"):
            raise ValueError(f"KV-cache {which} must be positive and finite, got {scale}")
        if which in ("k_scale", "kv_scale"):
            self.k_scale = scale
        if which in ("v_scale", "kv_scale"):
            self.v_scale = scale

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> FullAttentionSpec:
        if self.sliding_window:
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, dtype, self.sliding_window)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                rotary: RotaryEmbedding | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D]. With ``rotary`` (and ``positions``), q and k are rotated
        here, in the same pass that stores k and v in the cache. The store and the attention read the step's
        metadata: a prefill CUDA graph is cut around them (``attention_piece``)."""
        if rotary is None:
            return attention_piece(self._attend, (q, k, v), batch)
        return attention_piece(functools.partial(self._rotate_and_attend, rotary), (q, k, v, positions), batch)

    def _rotate_and_attend(self, rotary: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, batch, rotary, positions)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                rotary: RotaryEmbedding | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        scales = (self.k_scale, self.v_scale)
        group = self.kv_group
        block_tables, slot_mapping = batch.kv_tables(group)
        # what the torch path derives from the batch, shared by the layers of the step (built on first use only)
        stored = batch.derive(("stored_rows", group), lambda: StoredRows(slot_mapping))
        if rotary is not None:
            angles = batch.derive(("rotary_angles", id(rotary.cos_sin_cache)),
                                  lambda: RotaryAngles(positions, rotary.cos_sin_cache))
            q = ops.rotary_store_kv(positions, q, k, v, rotary.cos_sin_cache, rotary.is_neox, self.kv_cache,
                                    slot_mapping, scales, angles, stored, native_cpu=self.native_cpu)
        else:
            ops.store_kv(k, v, self.kv_cache, slot_mapping, scales, stored)
        block_size = self.kv_cache.shape[2]
        plan = batch.derive(("attention_plan", group, self.sliding_window, block_size, self.native_cpu),
                            lambda: AttentionPlan(block_tables, batch.query_start_loc, batch.seq_lens,
                                                  self.sliding_window, block_size, self.native_cpu))
        # the batch's host-side bounds spare the kernels a host sync (and make decode capturable in a graph)
        out = ops.paged_attention(q, self.kv_cache, block_tables, batch.query_start_loc, batch.seq_lens,
                                  self.scale, self.sliding_window, max_query_len=batch.max_query_len,
                                  max_seq_len=batch.max_seq_len, kv_scales=scales, plan=plan,
                                  sinks=self.sinks)
        return out.reshape(-1, self.num_heads * self.head_dim)
