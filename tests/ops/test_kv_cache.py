from __future__ import annotations

import pytest
import torch

from dsinfer.ops import store_kv
from dsinfer.ops.kv_cache import store_kv_ref


def _case(num_tokens, num_blocks, block_size, heads, head_dim, dtype, device, skip_every=0):
    gen = torch.Generator().manual_seed(num_tokens * 31 + block_size)
    cache = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    k = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype).to(device)
    return k, v, cache, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,head_dim", [(1, 64), (4, 32), (3, 48)])
def test_store_kv_writes_exactly_the_mapped_slots(dtype, block_size, heads, head_dim, device):
    k, v, cache, slots = _case(37, 6, block_size, heads, head_dim, dtype, device)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_negative_slots_are_skipped(device):
    k, v, cache, slots = _case(20, 4, 16, 2, 32, torch.float32, device, skip_every=3)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_int32_slots_and_strided_kv_views(device):
    qkv = torch.randn(9, 8 + 2 * 2, 32, device=device)  # k and v as head slices of a fused projection
    k, v = qkv[:, 8:10], qkv[:, 10:12]
    cache = torch.randn(2, 3, 16, 2, 32, device=device)
    slots = torch.tensor([5, -1, 0, 47, 16, 17, 33, -1, 2], dtype=torch.int32, device=device)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots.long())
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_float32_kv_into_bf16_cache_rounds(device, assert_close):
    k, v, cache, slots = _case(16, 2, 16, 2, 32, torch.float32, device)
    cache = cache.to(torch.bfloat16)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert_close(cache, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_llama_kv_heads_on_gpu(num_tokens):
    k, v, cache, slots = _case(num_tokens, 1024, 16, 8, 128, torch.bfloat16, "cuda", skip_every=7)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)
