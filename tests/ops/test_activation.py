from __future__ import annotations

import pytest
import torch

from dsinfer.ops import silu_and_mul
from dsinfer.ops.activation import silu_and_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (6, 200), (2, 3, 2 * 1536)])
def test_silu_and_mul_matches_reference(dtype, shape, device, poisoned, assert_close):
    x = (2 * torch.randn(*shape, device=device)).to(dtype)
    out = silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, silu_and_mul_ref(x.double()), dtype)
    assert_close(out, silu_and_mul_ref(x), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 300])
def test_llama_intermediate_on_gpu(rows, assert_close):
    x = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x.double()), torch.bfloat16)
    assert_close(out, silu_and_mul_ref(x), torch.bfloat16, tol=2e-3)
