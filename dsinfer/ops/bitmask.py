"""Token bitmask (structured outputs): keep the logits of allowed tokens, set the others to ``-inf``.

``apply_token_bitmask(logits, bitmask)``: logits ``[S, V]`` float, bitmask ``[S, ceil(V / 32)]`` int32 where
bit ``t % 32`` of word ``t // 32`` set means token t is allowed (xgrammar's layout). Returns a new tensor (the
sampler keeps the raw logits for logprobs). Bits past V are ignored; tokens past the mask's width stay allowed
only if the mask covers them, so a mask narrower than V masks the rest.
"""

from __future__ import annotations

import torch

from dsinfer.ops.dispatch import use_triton


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, W] int32 -> [S, vocab_size] bool (True = allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=allowed.device)
    return torch.cat((allowed, pad), 1)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if use_triton(logits):
        from dsinfer.ops.triton.bitmask import apply_token_bitmask_triton

        return apply_token_bitmask_triton(logits, bitmask)
    return apply_token_bitmask_ref(logits, bitmask)
