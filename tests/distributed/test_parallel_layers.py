"""The tensor-parallel layers' weight loaders, one rank at a time (no process group): each rank keeps its slice
of the checkpoint's full tensor, and the slices of all ranks put back together are the tensor."""

from __future__ import annotations

import pytest
import torch

from dsinfer.distributed.state import ParallelState
from dsinfer.layers.embedding import VocabEmbedding
from dsinfer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dsinfer.layers.moe import FusedExperts


def _ranks(size: int) -> list[ParallelState]:
    return [ParallelState(tp_size=size, tp_rank=r) for r in range(size)]


def test_merged_column_shards_are_split_shard_by_shard():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    parts = []
    for tp in _ranks(2):
        layer = ColumnParallelLinear(3, [8, 8], tp)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        parts.append(layer.weight.data)
    assert torch.equal(parts[1], torch.cat([gate[4:], up[4:]]))  # [gate slice; up slice] per rank
    merged = ColumnParallelLinear(3, [8, 8], ParallelState(2, 1))
    merged.weight.weight_loader(merged.weight, torch.cat([gate, up]))  # a checkpoint that stores them merged
    assert torch.equal(merged.weight.data, parts[1])


def test_kv_heads_fewer_than_ranks_are_replicated():
    head_dim, q, kv = 2, torch.randn(8 * 2, 5), torch.randn(2 * 2, 5)
    layers = [QKVParallelLinear(5, head_dim, 8, 2, tp) for tp in _ranks(4)]
    for layer in layers:
        for name, tensor in (("q", q), ("k", kv), ("v", kv)):
            layer.weight.weight_loader(layer.weight, tensor, name)
    assert [layer.num_heads for layer in layers] == [2] * 4 and layers[0].num_kv_heads == 1
    keys = [layer.weight.data[4:6] for layer in layers]
    assert torch.equal(keys[0], kv[:2]) and torch.equal(keys[1], kv[:2]) and torch.equal(keys[3], kv[2:])
    assert torch.equal(torch.cat([layer.weight.data[:4] for layer in layers]), q)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide tensor_parallel_size \(4\)"):
        QKVParallelLinear(5, head_dim, 12, 3, ParallelState(4, 0))


def test_row_parallel_splits_columns_and_vocab_rows():
    w = torch.randn(4, 6)
    rows = [RowParallelLinear(6, 4, tp) for tp in _ranks(2)]
    for layer in rows:
        layer.weight.weight_loader(layer.weight, w)
    assert torch.equal(torch.cat([layer.weight.data for layer in rows], 1), w)
    table = torch.randn(10, 3)
    embeds = [VocabEmbedding(10, 3, tp) for tp in _ranks(2)]
    for e in embeds:
        e.weight.weight_loader(e.weight, table)
    assert torch.equal(embeds[1].weight.data, table[5:]) and embeds[1].first == 5


def test_experts_keep_their_intermediate_slice_of_stacked_and_shared_tensors():
    num, hidden, inter = 3, 4, 6
    w13, w2 = torch.randn(num, 2 * inter, hidden), torch.randn(num, hidden, inter)
    shared_gate, shared_down = torch.randn(2 * inter, hidden), torch.randn(hidden, 2 * inter)
    tp = ParallelState(2, 1)
    experts = FusedExperts(num, hidden, inter, None, num_shared=2, tp=tp)
    experts.w13.weight_loader(experts.w13, w13)
    experts.w2.weight_loader(experts.w2, w2)
    experts.w13.weight_loader(experts.w13, shared_gate, ("shared", "gate"))
    experts.w2.weight_loader(experts.w2, shared_down, ("shared", "down"))
    assert torch.equal(experts.w13.data[:num, :3], w13[:, 3:6])  # gate's second half
    assert torch.equal(experts.w13.data[:num, 3:], w13[:, 9:])  # up's second half
    assert torch.equal(experts.w2.data[:num], w2[:, :, 3:])
    assert torch.equal(experts.w13.data[num + 1, :3], shared_gate[9:12])  # shared chunk 1, rank 1's half
    assert torch.equal(experts.w2.data[num], shared_down[:, 3:6])
