"""V4 attention: shared-KV MQA over a sliding window plus, in CSA / HCA layers, the compressed entries.

Per token: ``q = RMS(wq_b(q_norm(wq_a(x))))`` per head (unweighted norm), one K=V head ``kv = norm(wkv(x))``,
both roped on their trailing ``rope_dim`` channels (``main`` rope in sliding layers, ``compress`` elsewhere).
A query at t attends, in one softmax with a learned per-head sink logit, to the window's keys (positions
t - window + 1 .. t) and to compressed entries: every visible one (HCA) or the indexer's top-k (CSA). The output's
rope channels are rotated back by -t (K is V, so V carried the keys' rotation), then the grouped output projection:
``wo_a`` maps each of ``o_groups`` head groups to ``o_lora_rank`` channels, ``wo_b`` mixes them.

Cache: compressed entries (and the indexer's keys) in paged blocks; the window's last ``window + max drafts`` keys
and the compressors' unpooled rows in the sequence's state slot (``StateSlotSpec``).
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer import batch_invariant
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.core.kv_cache_spec import BoundaryStates, BoundaryStateSpec, CompressedSpec, StateSlotSpec
from dsinfer.layers.linear import Linear
from dsinfer.layers.norm import RMSNorm
from dsinfer.models.deepseek_v4 import decode
from dsinfer.models.deepseek_v4.compressor import Compressor
from dsinfer.models.deepseek_v4.config import CSA, SLIDING, V4Config
from dsinfer.models.deepseek_v4.hyper import unweighted_rms_norm
from dsinfer.models.deepseek_v4.indexer import Indexer
from dsinfer.models.deepseek_v4.invariant import attend_invariant
from dsinfer.models.deepseek_v4.rope import V4Rope, apply_rope
from dsinfer.models.deepseek_v4.step import SeqStep, V4Step, capture_boundaries, read_ring, write_ring


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, max_position: int):
        super().__init__()
        self.kind, self.rate = cfg.layer_types[layer], cfg.rate(layer)
        self.num_heads, self.head_dim, self.window = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        self.groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        hidden, width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.wq_a = Linear(hidden, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, width)
        self.wkv = Linear(hidden, cfg.head_dim)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(width // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)  # one block per group
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, hidden)
        self.attn_sink = nn.Parameter(torch.empty(cfg.num_heads, dtype=torch.float32), requires_grad=False)
        rope_type = "main" if self.kind == SLIDING else "compress"
        self.rope = V4Rope(cfg.rope_dim, cfg.rope_parameters[rope_type], max_position)
        self.compressor = None if self.kind == SLIDING else Compressor(
            hidden, cfg.head_dim, self.rate, self.kind == CSA, self.rope, cfg.rms_norm_eps)
        self.indexer = None if self.kind != CSA else Indexer(
            hidden, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, self.rate, self.rope,
            cfg.rms_norm_eps)
        self.kv_cache: list[torch.Tensor] | None = None  # paged: [entries] or [entries, indexer keys]
        self.state: dict[str, torch.Tensor] | None = None  # the state slots' rings
        self.boundary: BoundaryStates | None = None  # the rings' rows at each block's end (prefix caching, store)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> CompressedSpec | None:
        """The paged part (None for a sliding layer: it pages nothing)."""
        if dtype.itemsize == 1:
            raise ValueError("kv_cache_dtype='fp8' is not supported for DeepSeek-V4 (its compressed entries and "
                             "window keys are stored unscaled); use 'auto'")
        if self.compressor is None:
            return None
        widths = (self.head_dim,) if self.indexer is None else (self.head_dim, self.indexer.head_dim)
        return CompressedSpec(block_size, self.rate, widths, dtype)

    def state_spec(self, max_draft_tokens: int, dtype: torch.dtype) -> StateSlotSpec:
        """The per-sequence part: rows a rejected draft may overwrite come on top of what a step must find."""
        rings = [("window", self.window + max_draft_tokens, self.head_dim)]
        for name, comp in (("compressor", self.compressor), ("indexer", self.indexer and self.indexer.compressor)):
            if comp is not None:
                rings.append((name, comp.ring_rows + max_draft_tokens, 4 * comp.dim if comp.overlap else 2 * comp.dim))
        return StateSlotSpec(tuple(rings), dtype)

    def boundary_spec(self, block_size: int, dtype: torch.dtype) -> BoundaryStateSpec:
        """The rows of the slot a step at a block's end B reads: the window's last window - 1 keys and, for CSA,
        both compressors' rows of the last full window (entry B / rate pools them); HCA's next window starts
        at B (a multiple of every rate), so its compressor reads nothing older."""
        rings = [("window", self.window - 1, self.head_dim)]
        for name, comp in (("compressor", self.compressor), ("indexer", self.indexer and self.indexer.compressor)):
            if comp is not None and comp.overlap:
                rings.append((name, comp.rate, 4 * comp.dim))
        return BoundaryStateSpec(block_size, tuple(rings), dtype)

    @property
    def max_draft_tokens(self) -> int:
        """The draft rows the rings hold beyond the window."""
        return self.state["window"].shape[1] - self.window

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_lora = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_lora).view(-1, self.num_heads, self.head_dim), self.eps)
        cos, sin = self.rope.angles(positions)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.norm(self.wkv(x)), cos, sin)
        if self.batched(batch):
            out = self._forward_decode(x, q, kv, q_lora, positions, decode.DecodeStep.of(batch))
        else:
            out = self._forward_seqs(x, q, kv, q_lora, positions, V4Step.of(batch))
        out = apply_rope(out, cos, -sin)
        return self.wo_b(self._grouped_o(out))

    def batched(self, batch: ForwardBatch) -> bool:
        """Whether the step takes the batched, host-read-free path (``decode``): every sequence has the same q
        tokens, within the rings' draft allowance (the deterministic mode keeps the per-sequence path)."""
        return not batch_invariant.is_enabled() and decode.uniform_q(batch, self.state["window"].shape[1],
                                                                        self.window)

    def _forward_decode(self, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, q_lora: torch.Tensor,
                        positions: torch.Tensor, step: decode.DecodeStep) -> torch.Tensor:
        b, n = step.num_seqs, step.q
        keys, visible = decode.window_keys(self.state["window"], step, kv.view(b, n, -1), self.window)
        chosen = None
        if self.compressor is not None:
            decode.compress(self.compressor, self.compressor.project(x), step, self.state["compressor"],
                            self.kv_cache[0])
        if self.indexer is not None:  # CSA: each query's top-k entries, gathered by index
            decode.compress(self.indexer.compressor, self.indexer.compressor.project(x), step,
                            self.state["indexer"], self.kv_cache[1])
            index_keys, seen = decode.gather_entries(self.kv_cache[1], step, self.rate)
            index_q, weights = self.indexer.queries(q_lora, x, positions)
            picked, counts = decode.select(self.indexer, index_q.view(b, n, *index_q.shape[1:]),
                                           weights.view(b, n, -1), index_keys, seen)
            chosen = decode.chosen_entries(self.kv_cache[0], step, picked, counts).to(keys.dtype), counts
        elif self.compressor is not None:  # HCA: every entry a query may see
            entries, seen = decode.gather_entries(self.kv_cache[0], step, self.rate)
            keys = torch.cat((keys, entries.to(keys.dtype)), dim=1)
            visible = torch.cat((visible, seen), dim=-1)
        out = decode.attend(q.view(b, n, *q.shape[1:]), keys, visible, self.attn_sink, self.head_dim ** -0.5,
                            chosen)
        decode.write_rows(self.state["window"], step, kv.view(b, n, -1))
        return out.flatten(0, 1)

    def _forward_seqs(self, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, q_lora: torch.Tensor,
                      positions: torch.Tensor, step: V4Step) -> torch.Tensor:
        """The per-sequence path (prefill, mixed steps, the deterministic mode): bounds read on the host."""
        drafts = self.max_draft_tokens
        if self.compressor is not None:
            self.compressor.step(self.compressor.project(x), step, self.state["compressor"], self.kv_cache[0],
                                 self.boundary, "compressor", drafts)
        index_q = None
        if self.indexer is not None:
            self.indexer.compressor.step(self.indexer.compressor.project(x), step, self.state["indexer"],
                                         self.kv_cache[1], self.boundary, "indexer", drafts)
            index_q = self.indexer.queries(q_lora, x, positions)
        out = torch.empty_like(q)
        for seq in step.seqs:
            out[seq.rows] = self._attend_seq(q[seq.rows], kv, positions[seq.rows], step, seq, index_q)
        for seq in step.seqs:  # after every read: a long chunk's own rows may wrap over rows read above
            capture_boundaries(self.boundary, "window", self.state["window"], step, seq, kv[seq.rows], drafts)
            write_ring(self.state["window"], seq.slot, seq, kv[seq.rows])
        return out

    def _attend_seq(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, step: V4Step, seq: SeqStep,
                    index_q: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One sequence's queries [n, heads, dim] over its window and its compressed entries -> [n, heads, dim]."""
        first = max(0, seq.num_computed - self.window + 1)
        context = torch.cat((read_ring(self.state["window"], seq.slot, range(first, seq.num_computed)).to(kv.dtype),
                             kv[seq.rows]))  # positions first .. end - 1
        entries = context.new_zeros(0, context.shape[1])
        chosen = torch.zeros(len(positions), 0, dtype=torch.bool, device=q.device)
        if self.compressor is not None:
            entries = self.compressor.gather(step, seq, self.kv_cache[0]).to(kv.dtype)
            if self.indexer is not None:
                index_keys = self.indexer.compressor.gather(step, seq, self.kv_cache[1])
                chosen = self.indexer.select(index_q[0][seq.rows], index_q[1][seq.rows], index_keys, positions)
            else:
                chosen = torch.arange(entries.shape[0], device=q.device) < ((positions + 1) // self.rate).unsqueeze(-1)
        if batch_invariant.is_enabled():
            by_offset = positions.unsqueeze(-1) - torch.arange(self.window, device=q.device)  # key j: position t - j
            window = context[(by_offset - first).clamp(min=0)]
            return attend_invariant(q, window, by_offset >= 0, entries, chosen, self.attn_sink,
                                    self.head_dim ** -0.5).to(q.dtype)
        key_pos = torch.arange(first, seq.end, device=q.device)
        visible = (key_pos <= positions.unsqueeze(-1)) & (key_pos > positions.unsqueeze(-1) - self.window)
        visible = torch.cat((visible, chosen), dim=1)
        keys = torch.cat((context, entries))
        scores = torch.einsum("nhd,ld->hnl", q, keys) * self.head_dim ** -0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        sink = self.attn_sink.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        logits = torch.cat((scores, sink), dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        return torch.einsum("hnl,ld->nhd", probs.to(keys.dtype), keys)

    def _grouped_o(self, out: torch.Tensor) -> torch.Tensor:
        """[T, heads, dim] -> [T, o_groups * o_lora_rank]: group g's heads through its own block of wo_a."""
        groups = out.reshape(out.shape[0], self.groups, -1).transpose(0, 1)  # [G, T, width / G]
        weight = self.wo_a.weight.view(self.groups, -1, groups.shape[-1])  # [G, o_lora_rank, width / G]
        return torch.bmm(groups, weight.transpose(1, 2)).transpose(0, 1).flatten(1)
