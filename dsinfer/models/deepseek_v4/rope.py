"""V4's rotary embedding: interleaved pairs on the trailing ``rope_dim`` channels of a head, angles computed per call.

Two setups per model: ``main`` (sliding layers, plain RoPE) and ``compress`` (CSA / HCA layers, their compressed
entries and their indexer: ``compress_rope_theta``, YaRN where the config says). cos / sin are computed from the
positions at each call rather than read from a table: V4's context is a million tokens, whose table would cost
256 MB per setup for a few multiplies saved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsinfer.layers.rotary import compute_inv_freq


class V4Rope(nn.Module):
    def __init__(self, rope_dim: int, params: dict[str, Any], max_position: int):
        super().__init__()
        inv_freq, self.attention_factor = compute_inv_freq(rope_dim, params, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim / 2] (float32) at ``positions`` [T]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of x [T, ..., D] in interleaved pairs (a, b) ->
    (a cos - b sin, b cos + a sin), in float32; cos / sin [T, r / 2] broadcast over x's middle dims. Pass ``-sin``
    for the inverse rotation."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rope_dim:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)
