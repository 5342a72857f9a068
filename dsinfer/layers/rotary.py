"""Rotary embeddings: inverse frequencies for each scaling type (default, linear, llama3, yarn) and a cos/sin cache.

Configs name the parameters two ways: hub checkpoints write ``rope_theta`` + ``rope_scaling``; transformers >= 5
writes ``rope_parameters`` (with ``rope_theta`` inside). ``rope_parameters_of`` reads both.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dsinfer import ops


def rope_parameters_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """One dict with ``rope_type``, ``rope_theta`` and the scaling fields, whichever way the config wrote them."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / p["low_freq_factor"], old_len / p["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, p: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor") or max_position / p["original_max_position_embeddings"]
    old_len = p.get("original_max_position_embeddings") or max_position
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], factor applied to cos and sin) for the config's rope type."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type in ("yarn", "deepseek_yarn"):
        return _yarn_inv_freq(rotary_dim, base, params, max_position)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn")


_CACHES: dict[tuple, torch.Tensor] = {}


def _cos_sin_cache(rotary_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    """One cache per distinct rope setup and device, shared by every layer (V3: 61 layers x 42 MB otherwise)."""
    device = torch.get_default_device()
    key = (rotary_dim, max_position, repr(sorted(params.items())), str(device))
    cache = _CACHES.get(key)
    if cache is None:
        with torch.device("cpu"):  # computed on the host whatever the default device (meta, for sizing)
            inv_freq, attention_factor = compute_inv_freq(rotary_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq.cpu())
        cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1).to(device)
        _CACHES[key] = cache
    return cache


class RotaryEmbedding(nn.Module):
    """Applies rope to q and k at given positions from a cos/sin cache (float32, built once per setup)."""

    def __init__(self, rotary_dim: int, max_position: int, params: dict[str, Any], is_neox: bool = True):
        super().__init__()
        self.rotary_dim, self.is_neox = rotary_dim, is_neox
        self.register_buffer("cos_sin_cache", _cos_sin_cache(rotary_dim, max_position, params), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return ops.apply_rotary(positions, q, k, self.cos_sin_cache, self.is_neox)
