from __future__ import annotations

import pytest
import torch

from dsinfer.ops import cpu_quant, rms_norm
from dsinfer.ops.norm import rms_norm_cpu, rms_norm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 4096), (5, 1000)])
def test_rms_norm_matches_reference(dtype, rows, hidden, device, poisoned, assert_close):
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    assert_close(out, rms_norm_ref(x.double(), w.double(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_returns_normed_sum_and_sum(dtype, device, poisoned, assert_close):
    x = torch.randn(2, 3, 256, device=device).to(dtype)
    res = torch.randn(2, 3, 256, device=device).to(dtype)
    w = torch.randn(256, device=device).to(dtype)
    out, total = rms_norm(x, w, 1e-5, res)
    ref_out, ref_total = rms_norm_ref(x, w, 1e-5, res)
    assert out.shape == total.shape == x.shape
    assert_close(total, ref_total, dtype, tol=1e-6 if dtype == torch.float32 else 4e-3)
    assert_close(out, rms_norm_ref((x.double() + res.double()), w.double(), 1e-5), dtype)
    assert_close(out, ref_out, dtype)


def test_float32_weight_with_bf16_input_promotes_like_torch(device, assert_close):
    x = torch.randn(3, 128, device=device).to(torch.bfloat16)
    w = torch.randn(128, device=device)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256, 8192])
def test_llama_hidden_on_gpu(rows, assert_close):
    x, res = torch.randn(2, rows, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out, total = rms_norm(x, w, 1e-5, res)
    ref_out, ref_total = rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(total, ref_total)
    assert_close(out, ref_out, torch.bfloat16, tol=2e-3)


native = pytest.mark.skipif(not cpu_quant.native_available(), reason="the C++ kernels did not build here")


@native
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (2, 3, 1000)])
def test_cpu_kernel_matches_the_reference_with_and_without_residual(shape):
    torch.manual_seed(0)
    x, res = torch.randn(shape) * 3, torch.randn(shape)
    w = 1 + 0.1 * torch.randn(shape[-1])
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    out, total = rms_norm_cpu(x, w, 1e-5, res)
    ref_out, ref_total = rms_norm_ref(x, w, 1e-5, res)
    assert out.shape == total.shape == x.shape
    assert torch.equal(total, ref_total)  # the residual sum is the same float add
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)  # a non-contiguous input is copied first
    torch.testing.assert_close(rms_norm_cpu(strided, w, 1e-5), rms_norm_ref(x, w, 1e-5), rtol=1e-6, atol=1e-6)
