"""MXFP4 weights (OCP microscaling FP4, GPT-OSS's experts), dequantized on load.

A checkpoint stores a quantized ``name`` as ``name_blocks`` ``[..., G, 16]`` uint8 (32 e2m1 values per group,
two a byte, the low nibble first) and ``name_scales`` ``[..., G]`` uint8 (one ue8m0 exponent per group: the
group's values are multiplied by ``2 ** (scale - 127)``). Dequantized, the last dim holds ``G * 32`` values in
order. Every e2m1 value times a power of two is exact in bfloat16 and float32, so the result does not depend on
the dtype it is computed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

# e2m1: sign, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] of ``dtype``; one leading index at a time
    (an expert), so the float32 temporaries stay one expert's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)")
    if blocks.dim() > 2:
        return torch.stack([dequantize_mxfp4(b, s, dtype) for b, s in zip(blocks, scales)])
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]), dim=-1).flatten(-2)  # [G, 32]
    values = torch.ldexp(values, scales.int().unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def pair_mxfp4(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
               layout: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint (name, tensor) pairs with each ``name_blocks`` + ``name_scales`` pair replaced by one
    dequantized ``name`` (yielded, through ``layout``, when its second half arrives); others pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for part in ("blocks", "scales"):
            if name.endswith(f"_{part}"):
                base = name[:-len(part) - 1]
                halves = pending.setdefault(base, {})
                halves[part] = tensor
                if len(halves) == 2:
                    del pending[base]
                    yield base, layout(dequantize_mxfp4(halves["blocks"], halves["scales"], dtype))
                break
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half (blocks or scales): {sorted(pending)[:4]}")
