"""Dequantize-on-load for DeepSeek-V4's published formats: FP8 block-scaled linears and FP4 routed experts.

A quantized weight ``P.weight`` comes with its scales under ``P.scale`` (the published name) or
``P.weight_scale_inv`` (transformers'), one scale per block of the weight; the block shape follows from the two
shapes (FP8 linears: 128 x 128 blocks; FP4 experts: 1 x 32). FP8 weights are e4m3; FP4 weights are int8 bytes
holding two e2m1 values (low nibble first), the ``expert_dtype: fp4`` of the config. Scales are float32 or ue8m0
(``float8_e8m0fnu``, or its raw exponent bytes as uint8: 2^(byte - 127)). Weights shipped unquantized (the
compressor and indexer projections, norms, the router) pass through. On CPU every weight is dequantized; the
GPU kernels that would read them packed do not exist yet, so the GPU path dequantizes too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_QUANTIZED = (torch.float8_e4m3fn, torch.int8)
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] int8 bytes -> [..., K] float32: byte b holds values 2i (low nibble) and 2i + 1 (high)."""
    table = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8).long()
    return torch.stack((table[u8 & 0xF], table[u8 >> 4]), dim=-1).flatten(-2)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.uint8:  # ue8m0 exponent bytes
        return (scales.float() - 127.0).exp2()
    return scales.float()


def dequantize(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A quantized weight [N, K] (FP8, or FP4 packed [N, K / 2]) times its scale per block -> float32 [N, K]."""
    values = unpack_fp4(weight) if weight.dtype == torch.int8 else weight.float()
    rows, cols = values.shape[-2:]
    grid_rows, grid_cols = scales.shape[-2:] if scales.dim() >= 2 else (1, 1)
    if rows % grid_rows or cols % grid_cols:
        raise ValueError(f"a quantized weight of shape {(rows, cols)} does not divide into its scale grid "
                         f"{(grid_rows, grid_cols)}")
    blocks = values.reshape(grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
    return (blocks * scale_values(scales).reshape(grid_rows, 1, grid_cols, 1)).reshape(rows, cols)


def _scale_of(name: str) -> str | None:
    """The weight prefix ``P`` a scale tensor's name belongs to (None: not a scale)."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return None


def dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every quantized weight replaced by its float32 dequantization (each paired
    with its scales, whichever of the two comes first); a quantized weight or a scale left unpaired is an error."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        prefix = _scale_of(name)
        if prefix is not None:
            if prefix in weights_waiting:
                yield f"{prefix}.weight", dequantize(weights_waiting.pop(prefix), tensor)
            else:
                scales_waiting[prefix] = tensor
        elif name.endswith(".weight") and tensor.dtype in _QUANTIZED:
            prefix = name[:-len(".weight")]
            if prefix in scales_waiting:
                yield name, dequantize(tensor, scales_waiting.pop(prefix))
            else:
                weights_waiting[prefix] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        raise ValueError(f"quantized weights without scales {sorted(weights_waiting)[:3]} or scales without "
                         f"weights {sorted(scales_waiting)[:3]} in the checkpoint")
