from __future__ import annotations

import pytest
import torch

from dsinfer.ops import apply_rotary, cpu_quant, rotary_store_kv
from dsinfer.ops.rotary import apply_rotary_ref, rotary_store_kv_ref


def _cos_sin_cache(max_pos: int, rotary_dim: int, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (48, 16)])
def test_rotary_matches_reference(is_neox, dtype, head_dim, rotary_dim, device, poisoned, assert_close):
    num_tokens, q_heads, k_heads = 11, 4, 2
    cache = _cos_sin_cache(128, rotary_dim, device)
    positions = torch.randint(0, 128, (num_tokens,), device=device)
    q = torch.randn(num_tokens, q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, k_heads, head_dim, device=device).to(dtype)
    q_out, k_out = apply_rotary(positions, q, k, cache, is_neox)
    q_ref, k_ref = apply_rotary_ref(positions, q.double(), k.double(), cache.double(), is_neox)
    assert q_out.dtype == k_out.dtype == dtype
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])  # pass-through features are copied


def test_rotary_reads_strided_views_of_a_fused_projection(device, assert_close):
    qkv = torch.randn(5, 8 + 2 + 2, 32, device=device)
    q, k = qkv[:, :8], qkv[:, 8:10]
    cache = _cos_sin_cache(16, 32, device)
    positions = torch.tensor([0, 3, 15, 7, 7], device=device)
    q_out, k_out = apply_rotary(positions, q, k, cache, True)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache, True)
    assert_close(q_out, q_ref, torch.float32)
    assert_close(k_out, k_ref, torch.float32)
    q_out, k_out = apply_rotary(positions, q, k, cache, False)
    q_ref, _ = apply_rotary_ref(positions, q, k, cache, False)
    assert_close(q_out, q_ref, torch.float32)


def _rotary_store_case(num_tokens, q_heads, kv_heads, head_dim, rotary_dim, dtype, device, seed=0):
    """q, k, v as strided views of one fused qkv output, a cache [2, 5, 4, Hkv, D] poisoned with NaN, slots with
    a negative (skipped) entry."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads:q_heads + kv_heads], qkv[:, q_heads + kv_heads:]
    kv_cache = torch.full((2, 5, 4, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(20, generator=gen)[:num_tokens]
    slots[1] = -1
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(device)
    return positions, q, k, v, _cos_sin_cache(64, rotary_dim, device), kv_cache, slots.to(device)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 32), (48, 16)])
def test_rotary_store_kv_matches_rotary_then_store(is_neox, dtype, head_dim, rotary_dim, device, assert_close):
    """The fused op returns the rotated q and leaves the cache exactly as apply_rotary + store_kv would: rotated
    k and v in the mapped slots, the skipped slot's and every other row untouched (still NaN)."""
    positions, q, k, v, cos_sin, kv_cache, slots = _rotary_store_case(7, 4, 2, head_dim, rotary_dim, dtype, device)
    cache_ref = kv_cache.clone().cpu()
    q_out = rotary_store_kv(positions, q, k, v, cos_sin, is_neox, kv_cache, slots)
    q_ref = rotary_store_kv_ref(positions.cpu(), q.cpu(), k.cpu(), v.cpu(), cos_sin.cpu(), is_neox, cache_ref,
                                slots.cpu())
    assert_close(q_out, q_ref, dtype)
    written = torch.zeros(2, 20, dtype=torch.bool)
    written[:, slots[slots >= 0].cpu()] = True
    flat, flat_ref = kv_cache.cpu().view(2, 20, -1), cache_ref.view(2, 20, -1)
    assert flat[~written].isnan().all()
    assert_close(flat[written], flat_ref[written], dtype)


@pytest.mark.skipif(not cpu_quant.native_available(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 32)])
def test_cpu_rotary_store_kernel_equals_the_torch_path_bit_for_bit(q_heads, kv_heads, head_dim, kernel_options):
    """The C++ rope + store (a quantized CPU model's layers): the same rotated q and cache as the torch path,
    exactly; the skipped slot and unmapped rows stay NaN; a call it does not fit (interleaved rope) keeps torch."""
    kernel_options(use_triton="never")  # the CPU production path
    positions, q, k, v, cos_sin, kv_cache, slots = _rotary_store_case(7, q_heads, kv_heads, head_dim, head_dim,
                                                                      torch.float32, "cpu")
    cache_ref = kv_cache.clone()
    q_out = rotary_store_kv(positions, q, k, v, cos_sin, True, kv_cache, slots, native_cpu=True)
    q_ref = rotary_store_kv_ref(positions, q, k, v, cos_sin, True, cache_ref, slots)
    assert torch.equal(q_out, q_ref)
    torch.testing.assert_close(kv_cache, cache_ref, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="position 64 is outside the rope cache"):
        rotary_store_kv(torch.full_like(positions, 64), q, k, v, cos_sin, True, kv_cache, slots, native_cpu=True)
    q_out = rotary_store_kv(positions, q, k, v, cos_sin, False, kv_cache, slots, native_cpu=True)
    assert torch.equal(q_out, rotary_store_kv_ref(positions, q, k, v, cos_sin, False, cache_ref, slots))


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
def test_llama_heads_on_gpu(is_neox, assert_close):
    cache = _cos_sin_cache(8192, 128, "cuda")
    positions = torch.randint(0, 8192, (1000,), device="cuda")
    q = torch.randn(1000, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    q_out, k_out = apply_rotary(positions, q, k, cache, is_neox)
    q_ref, k_ref = apply_rotary_ref(positions, q.double(), k.double(), cache.double(), is_neox)
    assert_close(q_out, q_ref, torch.bfloat16)
    assert_close(k_out, k_ref, torch.bfloat16)


@pytest.mark.gpu
def test_rotary_store_kv_llama_heads_on_gpu(assert_close):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(300, 32 + 16, 128, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    kv_cache = torch.zeros(2, 40, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache_ref = kv_cache.clone()
    slots = torch.randperm(640, generator=gen)[:300].cuda()
    positions = torch.randint(0, 8192, (300,), generator=gen).cuda()
    cos_sin = _cos_sin_cache(8192, 128, "cuda")
    q_out = rotary_store_kv(positions, q, k, v, cos_sin, True, kv_cache, slots)
    q_ref = rotary_store_kv_ref(positions, q, k, v, cos_sin, True, cache_ref, slots)
    assert_close(q_out, q_ref, torch.bfloat16)
    assert_close(kv_cache, cache_ref, torch.bfloat16)
