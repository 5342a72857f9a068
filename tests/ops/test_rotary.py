from __future__ import annotations

import pytest
import torch

from dsinfer.ops import apply_rotary
from dsinfer.ops.rotary import apply_rotary_ref


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
