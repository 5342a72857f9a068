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


@pytest.mark.parametrize("split_k, num_rows", [(2, 1), (4, 19), (16, 3)])
def test_fp8_block_linear_split_k(split_k, num_rows, device, poisoned, assert_close):
    """K split over programs whose float32 partials are summed in split order, then the bias: 160 columns are
    5 K tiles of 32, so 2 splits take 3 + 2 tiles, 4 shrink to 3 (2 + 2 + 1), 16 to 5 of one tile each."""
    from dsinfer.ops.triton.fp8 import fp8_block_linear_triton

    gen = torch.Generator().manual_seed(split_k)
    block = (16, 32)
    w_q, w_s = block_quantize(torch.randn(40, 160, generator=gen), block)
    x = torch.randn(num_rows, 160, generator=gen)
    bias = torch.randn(40, generator=gen)
    cfg = dict(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1, split_k=split_k)
    out = fp8_block_linear_triton(x.to(device), w_q.to(device), w_s.to(device), block, bias.to(device), config=cfg)
    assert_close(out, _emulated(x, w_q, w_s, block) + bias.double(), torch.float32, tol=1e-5)


def test_split_sizes_and_the_default_split():
    from dsinfer.ops.triton.split_k import default_split, split_sizes

    assert split_sizes(160, 32, 1) == (160, 1)
    assert split_sizes(160, 32, 2) == (96, 2)
    assert split_sizes(160, 32, 4) == (64, 3)  # no split left empty
    assert split_sizes(160, 32, 16) == (32, 5)
    assert split_sizes(7168, 128, 8) == (896, 8)
    cpu = torch.device("cpu")  # 8 notional SMs off CUDA
    assert default_split(33, 7168, 128, cpu) == 1  # 33 tiles already fill 16 program slots
    assert default_split(2, 7168, 128, cpu) == 8  # 16 // 2
    assert default_split(1, 7168, 128, cpu) == 8  # 16 // 1 = 16, a power of two, but 56 K tiles // 4 = 14 -> 8
    assert default_split(1, 512, 128, cpu) == 1  # 4 K tiles: one split's worth


def test_a_decode_buckets_split_is_dropped_past_64_rows(monkeypatch):
    """The tuned table's nearest bucket serves up to 4x its rows: 256 rows may get the 64-row entry, whose split
    would write 4 x 256 rows of float32 partials."""
    from dsinfer.ops.triton import fp8

    tuned = dict(block_m=64, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=4, split_k=4)
    monkeypatch.setattr(fp8, "nearest_config", lambda key, rows, is_cuda: dict(tuned))
    cuda = torch.device("cuda")  # only names the device: the tuned branch asks nothing of it
    assert fp8.dense_config(64, cuda, 7168, 16384)["split_k"] == 4
    assert "split_k" not in fp8.dense_config(65, cuda, 7168, 16384)


def test_split_k_is_refused_where_the_epilogue_needs_whole_sums(device):
    from dsinfer.ops.triton.moe import grouped_gemm

    a = torch.randn(4, 64, device=device)
    b = torch.randn(2, 32, 64, device=device)
    out = torch.empty(4, 16, device=device)
    cfg = dict(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1, split_k=2)
    with pytest.raises(ValueError, match="split_k"):
        grouped_gemm(a, b[0], out, cfg, gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4, 16])
def test_fp8_block_linear_split_k_at_v3_o_proj(split_k, assert_close):
    from dsinfer.ops.triton.fp8 import fp8_block_linear_triton

    gen = torch.Generator().manual_seed(5)
    block = (128, 128)
    w_q, w_s = block_quantize(torch.randn(7168, 16384, generator=gen) * 0.02, block)
    x = torch.randn(1, 16384, generator=gen).bfloat16()
    cfg = dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4, split_k=split_k)
    out = fp8_block_linear_triton(x.cuda(), w_q.cuda(), w_s.cuda(), block, config=cfg)
    assert_close(out, _emulated(x, w_q, w_s, block), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 64, 1000])
def test_fp8_block_linear_real_shapes(num_rows, assert_close):
    gen = torch.Generator().manual_seed(2)
    block = (128, 128)
    w_q, w_s = block_quantize(torch.randn(2112, 7168, generator=gen) * 0.02, block)  # V3 q_a+kv_a width
    x = torch.randn(num_rows, 7168, generator=gen).bfloat16()
    out = fp8_block_linear(x.cuda(), w_q.cuda(), w_s.cuda(), block)
    assert_close(out, _emulated(x, w_q, w_s, block), torch.bfloat16)
