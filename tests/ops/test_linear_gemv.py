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

    entries = {"dense,48,64,bfloat16": {"cublas": True}, "dense,32,64,bfloat16": dict(TILE, split_k=2)}
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
    finally:
        gemv._tuned.cache_clear()


def test_cpu_takes_torch():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 8, generator=gen), torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_dispatch_on_cuda(monkeypatch, kernel_options):
    from dsinfer.batch_invariant import batch_invariant
    from dsinfer.ops.triton import gemv

    calls = []
    real = gemv.linear_triton
    monkeypatch.setattr(gemv, "tuned_config", lambda rows, weight, gated=False: dict(TILE, block_k=128, split_k=2))
    monkeypatch.setattr(gemv, "linear_triton", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(GEMV_MAX_ROWS + 1, 512, device="cuda", dtype=torch.bfloat16)
    out = linear(x[:1], w)
    torch.testing.assert_close(out.float(), (x[:1].double() @ w.double().t()).float(), rtol=2e-2, atol=2e-2)
    assert calls == [(1, 512)]
    linear(x, w)  # 65 rows: a GEMM
    kernel_options(triton_gemv=False)
    linear(x[:1], w)
    kernel_options(triton_gemv=True)
    with batch_invariant(True):
        linear(x[:1], w)
    assert calls == [(1, 512)]



# ---- the merged gate/up projection with SiLU(gate) * up in the same kernel ----

def _silu_mul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tma", [False, True])
def test_gated_tile_matches_float64(dtype, tma, device, poisoned, assert_close):
    from dsinfer.ops.triton.gemv import linear_silu_mul_triton

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2 * 72, 160, generator=gen).to(dtype)  # 72 outputs: a partial column tile; 5 K tiles
    x = torch.randn(3, 160, generator=gen).to(dtype)
    cfg = dict(TILE, split_k=4, tma=tma)  # a split in the entry is ignored: the SiLU needs whole sums
    out = linear_silu_mul_triton(x.to(device), w.to(device), cfg)
    assert out.dtype == dtype and out.shape == (3, 72)
    assert_close(out, _silu_mul_ref(x, w), dtype)


def test_linear_silu_mul_takes_the_tuned_gated_tile_or_the_two_ops(monkeypatch, device):
    from dsinfer.ops import linear as linear_mod
    from dsinfer.ops.activation import silu_and_mul
    from dsinfer.ops.linear import linear_silu_mul
    from dsinfer.ops.triton import gemv

    gen = torch.Generator().manual_seed(4)
    w, x, b = torch.randn(64, 48, generator=gen), torch.randn(2, 48, generator=gen), torch.randn(64, generator=gen)
    w, x, b = w.to(device), x.to(device), b.to(device)
    assert torch.equal(linear_silu_mul(x, w, b), silu_and_mul(linear(x, w, b)))  # no tuned entry
    calls = []
    monkeypatch.setattr(linear_mod, "_tuned_tile", lambda x, w, gated=False: dict(TILE) if gated else None)
    monkeypatch.setattr(gemv, "linear_silu_mul_triton", lambda *a: calls.append(a[2]) or silu_and_mul(x @ w.t()))
    linear_silu_mul(x, w)
    assert len(calls) == 1
    assert torch.equal(linear_silu_mul(x, w, b), silu_and_mul(linear(x, w, b)))  # a bias: the two ops
    assert len(calls) == 1
    # KernelConfig.fused_silu_mul off (DSINFER_FUSED_SILU_MUL=0, the sweep's switch): the two ops
    assert torch.equal(linear_silu_mul(x, w, fused=False), silu_and_mul(linear(x, w)))
    assert len(calls) == 1


def test_gated_table_entries(monkeypatch):
    from dsinfer.ops.triton import gemv

    entries = {"dense_silu_mul,32,64,bfloat16": dict(TILE), "dense_silu_mul,48,64,bfloat16": {"unfused": True},
               "dense,64,64,bfloat16": dict(TILE)}
    monkeypatch.setattr(gemv, "nearest_config", lambda key, rows, is_cuda: dict(entries[key]) if key in entries
                        else None)
    gemv._tuned.cache_clear()
    try:
        bf16 = torch.bfloat16
        assert gemv.tuned_config(1, torch.empty(64, 64, dtype=bf16), gated=True) == TILE  # 2 x 32 rows
        assert gemv.tuned_config(1, torch.empty(64, 64, dtype=bf16))["block_n"] == 32  # the plain entry
        assert gemv.tuned_config(1, torch.empty(96, 64, dtype=bf16), gated=True) is None  # the two ops won
        assert gemv.tuned_config(1, torch.empty(65, 64, dtype=bf16), gated=True) is None  # odd rows: not gate/up
        assert gemv.tuned_config(17, torch.empty(64, 64, dtype=bf16), gated=True) is None  # two row tiles
    finally:
        gemv._tuned.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 16])
def test_gated_tile_at_llama_shape_on_gpu(rows):
    from dsinfer.ops.triton.gemv import linear_silu_mul_triton

    gen = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(2 * 14336, 4096, device="cuda", generator=gen) / 64).bfloat16()
    x = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
    for tma in (False, True):
        cfg = dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4, tma=tma)
        out = linear_silu_mul_triton(x, w, cfg)
        ref = _silu_mul_ref(x, w)
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-2, (tma, err)
