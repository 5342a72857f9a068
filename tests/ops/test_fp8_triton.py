"""Triton FP8 block-scaled linear (w8a8, per-token-group activations) and the group quantizer."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.fp8 import block_dequantize, block_quantize, fp8_block_linear, fp8_block_linear_ref


def test_per_token_group_quant_round_trips_within_e4m3_precision(device, poisoned):
    from dsinfer.ops.triton.fp8 import per_token_group_quant

    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(0)).to(device) * 3
    q, s = per_token_group_quant(x, 32)  # groups of 32, the last one partial (16 values)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    back = q.float() * s.repeat_interleave(32, dim=1)[:, :80]
    assert ((back - x).abs() <= x.abs() / 16 + 1e-6).all()  # e4m3: 3 mantissa bits
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((5,), 448.0, device=device))


def _emulated(x, w_q, w_s, block):
    """The w8a8 product computed exactly (float64): quantize x per token group as the kernel does."""
    xd = x.double().cpu()
    groups = xd.view(xd.shape[0], -1, block[1])
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    xq = (groups / scale).float().to(torch.float8_e4m3fn).double() * scale
    return xq.view_as(xd) @ block_dequantize(w_q, w_s, block, torch.float64).cpu().T


@pytest.mark.parametrize("num_rows, block", [(1, (16, 32)), (19, (32, 16))])
def test_fp8_block_linear_matches_emulated_w8a8(num_rows, block, device, poisoned, assert_close):
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(48, 64, generator=gen)
    w_q, w_s = block_quantize(w, block)
    x = torch.randn(num_rows, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    out = fp8_block_linear(x.to(device), w_q.to(device), w_s.to(device), block, bias.to(device))
    assert_close(out, _emulated(x, w_q, w_s, block) + bias.double(), torch.float32, tol=1e-5)
    ref = fp8_block_linear_ref(x.double(), w_q, w_s, block, bias.double())  # activations unquantized
    assert_close(out, ref, torch.float32, tol=6e-2)


@pytest.mark.parametrize("tma", [False, True])
def test_fp8_block_linear_tile_configs(tma, device, poisoned, assert_close):
    """A tile wider than the scale block (per-column scales) and TMA descriptors (rows past M and N zero)."""
    from dsinfer.ops.triton.fp8 import fp8_block_linear_triton

    gen = torch.Generator().manual_seed(3)
    block = (16, 32)
    w = torch.randn(48, 96, generator=gen)
    w_q, w_s = block_quantize(w, block)
    x = torch.randn(19, 96, generator=gen)
    cfg = dict(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1, tma=tma)
    out = fp8_block_linear_triton(x.to(device), w_q.to(device), w_s.to(device), block, config=cfg)
    assert_close(out, _emulated(x, w_q, w_s, block), torch.float32, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 64, 1000])
def test_fp8_block_linear_real_shapes(num_rows, assert_close):
    gen = torch.Generator().manual_seed(2)
    block = (128, 128)
    w_q, w_s = block_quantize(torch.randn(2112, 7168, generator=gen) * 0.02, block)  # V3 q_a+kv_a width
    x = torch.randn(num_rows, 7168, generator=gen).bfloat16()
    out = fp8_block_linear(x.cuda(), w_q.cuda(), w_s.cuda(), block)
    assert_close(out, _emulated(x, w_q, w_s, block), torch.bfloat16)
