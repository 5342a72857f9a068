"""What an op derives from a step's batch is data of that step (``AttentionPlan``, ``StoredRows``,
``RotaryAngles``, ``PackedContexts``, kept on ``ForwardBatch.derive``), never a memo keyed by tensor identity: a
batch whose tensors are refilled in place, or a second batch of the same shapes, gets its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.layers.attention import Attention
from dsinfer.ops._common import PackedContexts
from dsinfer.ops.attention import AttentionPlan, paged_attention_ref
from dsinfer.ops.kv_cache import StoredRows, store_kv_ref
from dsinfer.ops.rotary import RotaryAngles, apply_rotary_ref
from tests.ops.test_attention import _batch

SCALE = 0.125


def _fresh(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def test_a_batch_refilled_in_place_gets_its_own_attention_plan():
    """The decode graphs refill the same batch tensors every step: the plan follows their values."""
    q, cache, tables, qsl, lens = _batch([1, 1, 1], [5, 17, 40], 4, 2, 16, 16, torch.float32, "cpu")
    first = paged_attention_ref(q, cache.nan_to_num(), tables, qsl, lens, SCALE)
    lens.copy_(torch.tensor([40, 3, 9], dtype=torch.int32))  # another step, the same tensors
    tables.copy_(tables.flip(0))
    second = paged_attention_ref(q, cache.nan_to_num(), tables, qsl, lens, SCALE)
    assert torch.equal(second, paged_attention_ref(q, cache.nan_to_num(), *_fresh(tables, qsl, lens), SCALE))
    assert not torch.equal(first, second)


def test_two_batches_of_one_shape_in_a_row_each_take_their_plan():
    a = _batch([1, 6, 1], [9, 6, 30], 4, 2, 16, 16, torch.float32, "cpu", seed=1)
    b = _batch([1, 6, 1], [30, 6, 2], 4, 2, 16, 16, torch.float32, "cpu", seed=2)
    for q, cache, tables, qsl, lens in (a, b, a):
        plan = AttentionPlan(tables, qsl, lens, None, cache.shape[2])
        out = paged_attention_ref(q, cache.nan_to_num(), tables, qsl, lens, SCALE, plan=plan)
        assert torch.equal(out, paged_attention_ref(q, cache.nan_to_num(), *_fresh(tables, qsl, lens), SCALE))


def test_a_plan_made_for_another_window_or_block_size_is_refused():
    q, cache, tables, qsl, lens = _batch([1, 1], [5, 17], 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="window 8 and blocks of 16"):
        paged_attention_ref(q, cache, tables, qsl, lens, SCALE, plan=AttentionPlan(tables, qsl, lens, 8, 16))
    with pytest.raises(ValueError, match="blocks of 32"):
        paged_attention_ref(q, cache, tables, qsl, lens, SCALE, plan=AttentionPlan(tables, qsl, lens, None, 32))


def test_the_store_skips_the_padding_of_this_step_not_the_last():
    k, v = torch.randn(2, 3, 2, 8).unbind(0)
    cache = torch.zeros(2, 2, 4, 2, 8)
    slots = torch.tensor([0, 1, 2])
    store_kv_ref(k, v, cache, slots)
    slots.copy_(torch.tensor([5, -1, 6]))  # refilled in place: now a padding row
    store_kv_ref(k * 2, v * 2, cache, slots)
    flat = cache.view(2, 8, 2, 8)
    assert torch.equal(flat[0, 5], 2 * k[0]) and torch.equal(flat[0, 6], 2 * k[2]) and torch.equal(flat[0, 1], k[1])
    shared = StoredRows(slots)  # one per step, for every layer
    other = torch.zeros_like(cache)
    store_kv_ref(k, v, other, slots, stored=shared)
    assert torch.equal(other.view(2, 8, 2, 8)[1, 6], v[2]) and shared.keep.tolist() == [True, False, True]


def test_rope_angles_follow_the_positions_of_this_step():
    cache = torch.randn(16, 8)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    positions = torch.tensor([1, 2, 3])
    apply_rotary_ref(positions, q, k, cache, True)
    positions.copy_(torch.tensor([9, 4, 0]))
    assert all(torch.equal(a, b) for a, b in zip(apply_rotary_ref(positions, q, k, cache, True),
                                                 apply_rotary_ref(positions.clone(), q, k, cache, True)))
    angles = RotaryAngles(positions, cache)
    assert all(torch.equal(a, b) for a, b in zip(apply_rotary_ref(positions, q, k, cache, True, angles),
                                                 apply_rotary_ref(positions.clone(), q, k, cache, True)))
    with pytest.raises(ValueError, match="another cos/sin cache"):
        apply_rotary_ref(positions, q, k, cache.clone(), True, angles)


def test_packed_contexts_are_the_slots_of_each_sequence_in_turn():
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    slots, cu = PackedContexts(tables, torch.tensor([5, 2], dtype=torch.int32), 4).slots_and_starts
    assert slots.tolist() == [12, 13, 14, 15, 4, 0, 1] and cu.tolist() == [0, 5, 7]


def _forward_batch(q_lens, ctx_lens, seed, block_size=16, device="cpu"):
    q, cache, tables, qsl, lens = _batch(q_lens, ctx_lens, 4, 2, 16, block_size, torch.float32, device, seed=seed)
    starts = qsl[:-1].long()
    positions = torch.cat([torch.arange(n - m, n) for m, n in zip(q_lens, ctx_lens)])
    slots = torch.full((sum(q_lens),), -1, dtype=torch.int64)  # their keys are cached already: store nothing
    batch = ForwardBatch(input_ids=torch.zeros(len(positions), dtype=torch.int64, device=device),
                         positions=positions.to(device), slot_mapping=slots.to(device), block_tables=tables,
                         query_start_loc=qsl, seq_lens=lens, logits_indices=starts, max_query_len=max(q_lens),
                         max_seq_len=max(ctx_lens))
    return q.flatten(1), cache.nan_to_num(), batch


def _layer(cache: torch.Tensor) -> Attention:
    layer = Attention(4, 16, 2, SCALE)
    layer.kv_cache = cache
    return layer


def test_the_attention_layer_derives_once_per_batch(kernel_options):
    kernel_options(use_triton="never")
    q, cache, batch = _forward_batch([1, 4, 1], [7, 4, 20], seed=3)
    k = v = torch.zeros(q.shape[0], 2 * 16)
    layer = _layer(cache)
    out = layer(q, k, v, batch)
    plans = [value for value in batch.derived.values() if isinstance(value, AttentionPlan)]
    assert len(plans) == 1 and "layout" in plans[0].__dict__  # built, on this path
    assert torch.equal(layer(q, k, v, batch), out)
    assert [value for value in batch.derived.values() if isinstance(value, AttentionPlan)] == plans  # shared
    # the next step, same shapes: its own plan, its own result
    q2, cache2, batch2 = _forward_batch([1, 4, 1], [20, 4, 3], seed=4)
    layer.kv_cache = cache2
    assert torch.equal(layer(q2, k, v, batch2), _layer(cache2.clone())(q2, k, v, dataclasses.replace(
        batch2, derived={})))
    assert not any(value is plans[0] for value in batch2.derived.values())


def test_the_triton_path_never_builds_the_torch_plan(device):
    """The plan's host syncs are the torch path's only: on the Triton path (CUDA graphs) it stays unbuilt."""
    q, cache, batch = _forward_batch([1, 1], [7, 20], seed=5, device=device)
    k = v = torch.zeros(q.shape[0], 2 * 16, device=device)
    _layer(cache)(q, k, v, batch)
    lazy = [value for value in batch.derived.values() if isinstance(value, (AttentionPlan, StoredRows))]
    assert len(lazy) == 2 and not any(set(value.__dict__) & {"layout", "keep"} for value in lazy)


def test_derive_builds_once_per_batch():
    _, _, batch = _forward_batch([1], [3], seed=6)
    builds = []
    assert batch.derive("x", lambda: builds.append(1) or "made") == "made"
    assert batch.derive("x", lambda: builds.append(1) or "again") == "made" and builds == [1]
    _, _, other = _forward_batch([1], [3], seed=6)
    assert other.derive("x", lambda: "its own") == "its own"
