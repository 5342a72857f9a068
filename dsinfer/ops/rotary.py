"""Rotary position embedding applied to q and k from a precomputed cos/sin cache.

``cos_sin_cache`` is [max_positions, rotary_dim] holding cos in the first half and sin in the second (the
scaling variant, llama3 / linear / YaRN, only changes the cache). Only the first ``rotary_dim`` features of
each head are rotated. ``is_neox``: rotate halves (x[:d/2], x[d/2:]); else the interleaved pairs (x[0::2],
x[1::2]).
"""

from __future__ import annotations

import functools

import torch

from dsinfer.ops.dispatch import use_triton
from dsinfer.ops.kv_cache import StoredRows, store_kv_ref


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rotary_dim]; cos/sin: [T, 1, rotary_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class RotaryAngles:
    """cos and sin [T, 1, rot/2] of the rope at ``positions`` (``cos_sin``), for the torch path. Gathered on first
    use and shared: a layer makes one per step from the batch (``batch.derive``) and passes it to every rope of
    the step; the Triton kernels read the cos/sin cache directly and never build it."""

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
        self.positions, self.cos_sin_cache = positions, cos_sin_cache

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[self.positions].float().unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def _cos_sin(positions, cos_sin_cache, angles: RotaryAngles | None) -> tuple[torch.Tensor, torch.Tensor]:
    if angles is None:
        return RotaryAngles(positions, cos_sin_cache).cos_sin
    if angles.cos_sin_cache is not cos_sin_cache:  # (positions may be another view of the step's: graph pieces)
        raise ValueError("the rotary angles were gathered from another cos/sin cache than this call's")
    return angles.cos_sin


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hk, D] view when k's heads directly follow q's in memory (both sliced from one
    fused qkv projection output, as the dense models do), else None."""
    if q.dtype != k.dtype or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return None
    if q.shape[0] > 1 and q.stride(0) != k.stride(0):  # (a size-1 dim's stride is arbitrary)
        return None
    if q.stride(2) != 1 or k.stride(2) != 1 or q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2]:
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def apply_rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
    angles: RotaryAngles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, Dq], k: [T, Hk, Dk] (Dq, Dk >= rotary_dim). Returns new (q, k) of the same dtype. ``angles``:
    the step's ``RotaryAngles`` of (positions, cos_sin_cache) (None: gathered here; the Triton path ignores it)."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = _cos_sin(positions, cos_sin_cache, angles)
    qk = _adjacent_heads(q, k)
    if qk is not None and rot == q.shape[-1]:  # one pass over both (half the small CPU ops of a layer's rope)
        out = _rotate(qk.float(), cos, sin, is_neox).to(q.dtype)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]
    out = []
    for x in (q, k):
        x_rot = _rotate(x[..., :rot].float(), cos, sin, is_neox).to(x.dtype)
        out.append(x_rot if x.shape[-1] == rot else torch.cat((x_rot, x[..., rot:]), dim=-1))
    return out[0], out[1]


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
    angles: RotaryAngles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        from dsinfer.ops.triton.rotary import apply_rotary_triton

        return apply_rotary_triton(positions, q, k, cos_sin_cache, is_neox, angles)
    return apply_rotary_ref(positions, q, k, cos_sin_cache, is_neox, angles)


def rotary_store_kv_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0),
    angles: RotaryAngles | None = None, stored: StoredRows | None = None,
) -> torch.Tensor:
    """``apply_rotary`` to q and k, then ``store_kv`` of the rotated k and v into ``kv_cache`` [2, blocks,
    block_size, Hkv, D] at ``slot_mapping`` (negative slots skipped). q, k, v: [T, H, D]. Returns the rotated q.
    ``angles`` / ``stored``: the step's, as ``apply_rotary`` / ``store_kv`` take them."""
    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache, is_neox, angles)
    store_kv_ref(k, v, kv_cache, slot_mapping, kv_scales, stored)
    return q


def rotary_store_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0),
    angles: RotaryAngles | None = None, stored: StoredRows | None = None, native_cpu: bool = False,
) -> torch.Tensor:
    """``native_cpu``: the C++ kernel where it applies (``csrc/cpu_rotary.cpp``, built with the quantized linears:
    ask only where ``cpu_quant.native_available()``): NeoX rope over whole heads, float32 q/k/v and cache on CPU;
    the same values as the torch path, in one op."""
    if use_triton(q):
        from dsinfer.ops.triton.rotary import rotary_store_kv_triton

        return rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, is_neox, kv_cache, slot_mapping,
                                      kv_scales, angles, stored)
    if native_cpu and _native_fits(q, k, v, cos_sin_cache, is_neox, kv_cache):
        return torch.ops.dsinfer_cpu.rotary_store_kv(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)
    return rotary_store_kv_ref(positions, q, k, v, cos_sin_cache, is_neox, kv_cache, slot_mapping, kv_scales,
                               angles, stored)


def _native_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
                 kv_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel takes this call (see ``rotary_store_kv``)."""
    dim = q.shape[-1]
    tensors = (q, k, v, cos_sin_cache, kv_cache)
    return (is_neox and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and cos_sin_cache.shape[-1] == k.shape[-1] == v.shape[-1] == dim
            and all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (q, k, v)))
