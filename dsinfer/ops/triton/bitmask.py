"""Triton ``apply_token_bitmask``: one program per (row, tile of BLOCK tokens); reads the packed words once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.triton.pdl import enter, launch_args

_BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, out_ptr, V, W, stride_l, stride_m, stride_o,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    words = tl.load(mask_ptr + row * stride_m + cols // 32, mask=in_vocab & (cols // 32 < W), other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    x = tl.load(logits_ptr + row * stride_l + cols, mask=in_vocab, other=0.0)
    x = tl.where(allowed, x, float("-inf"))
    tl.store(out_ptr + row * stride_o + cols, x, mask=in_vocab)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows == 0:
        return out
    bitmask = bitmask.to(logits.device, non_blocking=True)
    grid = (rows, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, out, vocab, bitmask.shape[1], logits.stride(0),
                                bitmask.stride(0), out.stride(0), BLOCK=_BLOCK, **launch_args(logits.device))
    return out
