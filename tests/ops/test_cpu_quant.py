"""CPU weight-only quantized linears (``ops.cpu_quant``) and the GGUF blocks loaded into them (``gguf_quant``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from dsinfer.models.loader.gguf_quant import _pack
from dsinfer.ops import cpu_quant
from dsinfer.ops.cpu_quant import QuantizedWeight

native = pytest.mark.skipif(not cpu_quant.native_available(), reason="the C++ kernel did not build here")


def _weight(fmt: str, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return cpu_quant.quantize(torch.randn(rows, cols, generator=gen) * 0.05, fmt)


@native
@pytest.mark.parametrize("fmt", cpu_quant.FORMATS)
@pytest.mark.parametrize("rows", [1, 4, 7, 33])
def test_kernel_matches_torch_reference(fmt, rows):
    w = _weight(fmt, 80, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 5] = 40.0  # an outlier in one block
    bias = torch.randn(80)
    got, ref = cpu_quant.quant_linear(x, w, bias), cpu_quant.quant_linear_ref(x, w, bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("fmt", cpu_quant.FORMATS)
def test_kernel_is_close_to_the_dense_product_of_its_weight(fmt):
    """int16 activations: the product differs from x @ dequantize(W)^T by far less than the weight's own error."""
    w = _weight(fmt, 64, 128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    dense = x @ cpu_quant.dequantize(w).T
    assert ((cpu_quant.quant_linear(x, w) - dense).norm() / dense.norm()).item() < 1e-4


@native
def test_kernel_zero_rows_and_batched_leading_dims():
    w = _weight("int4", 32, 64)
    x = torch.zeros(2, 3, 64)
    x[1, 2] = 1.0
    y = cpu_quant.quant_linear(x, w)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y[0], torch.zeros(3, 32))
    torch.testing.assert_close(y[1, 2], cpu_quant.dequantize(w).sum(1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", cpu_quant.FORMATS)
def test_quantize_error_is_within_half_a_step(fmt):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    q = cpu_quant.quantize(w, fmt)
    step = q.scales.float().repeat_interleave(cpu_quant.BLOCK, dim=1)
    err = (cpu_quant.dequantize(q) - w).abs()
    assert bool((err <= step * 0.5 + 1e-3 * w.abs().amax()).all())


def test_pack_int4_roundtrip_and_ggml_nibble_order():
    values = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    packed = cpu_quant.pack_int4(values)
    assert packed.shape == (1, 16)
    assert int(packed[0, 3]) == 3 | ((19 % 16) << 4)  # byte j: element j low, element j + 16 high
    assert torch.equal(cpu_quant.unpack_int4(packed), values)


def test_quantize_rejects_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_quant.quantize(torch.randn(4, 40), "int8")
    with pytest.raises(ValueError, match="format"):
        cpu_quant.quantize(torch.randn(4, 64), "int2")


# ------------------------------------------------------------------------------------------------------------
# GGUF blocks


def _tensor(kind: T, raw: np.ndarray, rows: int, cols: int) -> SimpleNamespace:
    """What ``_pack`` reads of a gguf-py ReaderTensor (GGUF lists the fastest dimension first)."""
    return SimpleNamespace(tensor_type=kind, data=raw, shape=np.array([cols, rows]))


def _random_k_blocks(kind: T, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K / Q6_K bytes with small float16 super-block scales (gguf-py cannot quantize to them)."""
    size = 144 if kind == T.Q4_K else 210
    raw = np.random.default_rng(4).integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scales = np.full((rows, cols // 256, 1), 0.003, dtype=np.float16).view(np.uint8)
    if kind == T.Q4_K:
        raw[..., 0:2], raw[..., 2:4] = scales, scales  # d, dmin
    else:
        raw[..., 208:210] = scales  # d comes last
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind,fmt", [(T.Q4_0, "int4"), (T.Q4_1, "int4"), (T.Q8_0, "int8"), (T.Q4_K, "int4"),
                                      (T.Q6_K, "int8"), (T.Q4_1, "int8"), (T.Q8_0, "int4")])
def test_gguf_blocks_load_into_packs(kind, fmt):
    rows, cols = 6, 512
    if kind in (T.Q4_K, T.Q6_K):
        raw = _random_k_blocks(kind, rows, cols)
    else:
        raw = gguf_quantize(np.random.default_rng(5).standard_normal((rows, cols)).astype(np.float32), kind)
    reference = torch.from_numpy(gguf_dequantize(raw, kind).astype(np.float32).reshape(rows, cols))
    qweight, scales, mins = _pack(_tensor(kind, raw, rows, cols), fmt)
    packed = QuantizedWeight(fmt, torch.from_numpy(qweight), torch.from_numpy(scales),
                             None if mins is None else torch.from_numpy(mins))
    got = cpu_quant.dequantize(packed)
    direct = {(T.Q4_0, "int4"), (T.Q4_1, "int4"), (T.Q8_0, "int8")}
    if (kind, fmt) in direct:  # the file's own blocks: the very same values
        assert torch.equal(got, reference)
    elif (kind, fmt) == (T.Q4_K, "int4"):  # d * sc and dmin * m rounded to float16 once: 2^-11 of the range
        assert (got - reference).abs().max().item() <= 2**-11 * reference.abs().max().item()
    else:  # requantized: within half a step of the target format
        step = packed.scales.float().repeat_interleave(cpu_quant.BLOCK, dim=1)
        assert bool(((got - reference).abs() <= step * 0.5 + 1e-4).all())
