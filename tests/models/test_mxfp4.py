"""MXFP4 dequantization against transformers' own (``integrations.mxfp4.convert_moe_packed_tensors``)."""

from __future__ import annotations

import pytest
import torch

from dsinfer.models.mxfp4 import dequantize_mxfp4, pair_mxfp4

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _random(experts: int, rows: int, groups: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 136, (experts, rows, groups), generator=gen, dtype=torch.uint8)  # 2^-9 .. 2^8
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype):
    blocks, scales = _random(3, 10, 4)
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, rows, G * 32]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, G * 32, rows]: transposed
    assert ours.dtype == dtype and ours.shape == (3, 10, 128)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_nibbles_low_first_and_scale_is_a_power_of_two():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x72  # low nibble 2 (1.0), high nibble 7 (6.0)
    blocks[0, 1] = 0x9F  # low nibble 15 (-6.0), high nibble 9 (-0.5)
    out = dequantize_mxfp4(blocks, torch.tensor([129], dtype=torch.uint8), torch.float32)  # x 4
    assert out.shape == (32,) and out[:4].tolist() == [4.0, 24.0, -24.0, -2.0] and not out[4:].any()


def test_pairs_blocks_with_scales_in_any_order():
    blocks, scales = _random(2, 4, 1, seed=1)
    weights = [("a.w_scales", scales), ("b", torch.ones(1)), ("a.w_blocks", blocks)]
    out = dict(pair_mxfp4(weights, torch.float32))
    assert sorted(out) == ["a.w", "b"] and torch.equal(out["a.w"], dequantize_mxfp4(blocks, scales, torch.float32))
    with pytest.raises(ValueError, match="other half"):
        list(pair_mxfp4([("a.w_blocks", blocks)], torch.float32))
