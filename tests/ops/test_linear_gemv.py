"""Few-row linears on the grouped GEMM kernel (``ops.linear``, ``ops.triton.gemv``): the tile against float64,
split-K included; the dispatch takes a tuned tile only where the table names one, on CUDA, outside the
batch-invariant mode, at up to 64 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsinfer.ops.linear import GEMV_MAX_ROWS, linear

HAS_CUDA = torch.cuda.is_available()
TILE = dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k, tma", [(1, False), (2, False), (4, True)])
def test_tile_matches_float64(dtype, split_k, tma, device, poisoned, assert_close):
    from dsinfer.ops.triton.gemv import linear_triton

    gen = torch.Generator().manual_seed(split_k)
    w = torch.randn(72, 160, generator=gen).to(dtype)  # a partial column tile; 5 K tiles
    x = torch.randn(3, 160, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype)
    out = linear_triton(x.to(device), w.to(device), bias.to(device), dict(TILE, split_k=split_k, tma=tma))
    assert out.dtype == dtype and out.shape == (3, 72)
    assert_close(out, x.double() @ w.double().t() + bias.double(), dtype)


@pytest.mark.parametrize("split_k, tma", [(1, False), (2, True)])
def test_silu_tile_reads_the_activation_silu_and_mul_writes(split_k, tma, device, poisoned):
    """The down tile that takes [gate | up] gives the bits of silu_and_mul's kernel followed by the plain tile:
    the same values reach the same products in the same order."""
    from dsinfer.ops.triton.activation import silu_and_mul_triton
    from dsinfer.ops.triton.gemv import linear_triton

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(72, 96, generator=gen).bfloat16()
    x = (torch.randn(3, 2 * 96, generator=gen) * 2).bfloat16().to(device)
    bias = torch.randn(72, generator=gen).bfloat16().to(device)
    cfg = dict(TILE, split_k=split_k, tma=tma)
    fused = linear_triton(x, w.to(device), bias, cfg, silu=True)
    two_kernels = linear_triton(silu_and_mul_triton(x), w.to(device), bias, cfg)
    assert torch.equal(fused, two_kernels)
    g, u = x.double().cpu().chunk(2, dim=-1)
    ref = (F.silu(g) * u) @ w.double().t() + bias.double().cpu()
    torch.testing.assert_close(fused.double().cpu(), ref, rtol=3e-2, atol=3e-2)


def test_silu_tile_refuses_what_it_cannot_read(device):
    from dsinfer.ops.triton.moe import grouped_gemm

    w = torch.randn(32, 64, device=device)
    out = torch.empty(2, 32, device=device)
    with pytest.raises(ValueError, match="silu_a"):
        grouped_gemm(torch.randn(2, 64, device=device), w, out, TILE, silu_a=True)  # not [rows, 2K]


def test_leading_dims_and_a_strided_input(device, assert_close):
    from dsinfer.ops.triton.gemv import linear_triton

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=gen)
    x = torch.randn(2, 3, 128, generator=gen)[..., ::2]  # last dim strided: copied first
    out = linear_triton(x.to(device), w.to(device), None, dict(TILE, split_k=2))
    assert out.shape == (2, 3, 40)
    assert_close(out, x.double() @ w.double().t(), torch.float32)


def test_table_entries(monkeypatch):
    from dsinfer.ops.triton import gemv

    entries = {"dense,48,64,bfloat16": {"cublas": True}, "dense,32,64,bfloat16": dict(TILE, split_k=2),
               "dense_silu,48,64,bfloat16": dict(TILE, split_k=4)}
    monkeypatch.setattr(gemv, "nearest_config", lambda key, rows, is_cuda: dict(entries[key]) if key in entries
                        else None)
    gemv._tuned.cache_clear()
    try:
        bf16 = torch.bfloat16
        assert gemv.tuned_config(1, torch.empty(48, 64, dtype=bf16)) is None  # cuBLAS won there
        assert gemv.tuned_config(1, torch.empty(32, 64, dtype=bf16))["split_k"] == 2
        assert gemv.tuned_config(16, torch.empty(32, 64, dtype=bf16))["split_k"] == 2  # one row tile of 16
        assert gemv.tuned_config(17, torch.empty(32, 64, dtype=bf16)) is None  # two row tiles: untimed
        assert gemv.tuned_config(1, torch.empty(16, 64, dtype=bf16)) is None  # never tuned
        assert gemv.tuned_config(1, torch.empty(64, 32, dtype=bf16).t()) is None  # not contiguous
        assert gemv.tuned_config(1, torch.empty(32, 64, dtype=torch.float8_e4m3fn)) is None
        assert gemv.tuned_config(1, torch.empty(48, 64, dtype=bf16), silu=True)["split_k"] == 4
        assert gemv.tuned_config(1, torch.empty(32, 64, dtype=bf16), silu=True) is None
    finally:
        gemv._tuned.cache_clear()


def test_cpu_takes_torch():
    """No tile on CPU: torch's linear, and the fused op is the two ops (the activation takes whichever path the
    op tests' ``DSINFER_USE_TRITON=always`` gives it, the interpreter's rounding included)."""
    from dsinfer.ops.activation import silu_and_mul
    from dsinfer.ops.linear import silu_mul_linear

    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 8, generator=gen), torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    x2 = torch.randn(2, 16, generator=gen)
    assert torch.equal(silu_mul_linear(x2, w, b), F.linear(silu_and_mul(x2), w, b))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_dispatch_on_cuda(monkeypatch):
    from dsinfer.batch_invariant import batch_invariant
    from dsinfer.ops.triton import gemv

    calls = []
    real = gemv.linear_triton
    monkeypatch.setattr(gemv, "tuned_config", lambda rows, weight, silu=False: dict(TILE, block_k=128, split_k=2))
    monkeypatch.setattr(gemv, "linear_triton", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(GEMV_MAX_ROWS + 1, 512, device="cuda", dtype=torch.bfloat16)
    out = linear(x[:1], w)
    torch.testing.assert_close(out.float(), (x[:1].double() @ w.double().t()).float(), rtol=2e-2, atol=2e-2)
    assert calls == [(1, 512)]
    linear(x, w)  # 65 rows: a GEMM
    monkeypatch.setenv("DSINFER_TRITON_GEMV", "0")
    linear(x[:1], w)
    monkeypatch.delenv("DSINFER_TRITON_GEMV")
    with batch_invariant(True):
        linear(x[:1], w)
    assert calls == [(1, 512)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_silu_dispatch_on_cuda(monkeypatch):
    from dsinfer.ops.activation import silu_and_mul_ref
    from dsinfer.ops.linear import silu_mul_linear
    from dsinfer.ops.triton import gemv

    tuned = {True: dict(TILE, block_k=128, split_k=2), False: None}
    monkeypatch.setattr(gemv, "tuned_config", lambda rows, weight, silu=False: tuned[silu])
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=gen).bfloat16().cuda()
    x = torch.randn(1, 1024, generator=gen).bfloat16().cuda()
    fused = silu_mul_linear(x, w)
    # the tile multiplies silu_and_mul's bf16 values (SiLU rounded, then the product): an activation rounded
    # otherwise moves these outputs (512 products of ~0.5) by up to ~0.2
    ref = (silu_and_mul_ref(x.cpu()).double() @ w.double().cpu().t()).float().cuda()
    torch.testing.assert_close(fused.float(), ref, rtol=2e-2, atol=2e-2)
    tuned[True] = None  # no silu tile: silu_and_mul, then the plain linear
    torch.testing.assert_close(silu_mul_linear(x, w).float(), ref, rtol=2e-2, atol=2e-2)
