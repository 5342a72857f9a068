"""Small host-side helpers shared by the Triton op wrappers."""

from __future__ import annotations

import functools

import torch

_CPU_SMS = 8  # a notional multiprocessor count for the CPU interpreter (exercises split paths in tests)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def has_fp8_convert(device: torch.device) -> bool:
    """Whether device converts FP8 pairs to fp16 in one instruction (``cvt.rn.f16x2.e4m3x2``: sm_89 and later)."""
    return device.type == "cuda" and _cuda_capability(_index(device)) >= (8, 9)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of device (cached); a small fixed number off CUDA."""
    if device.type != "cuda":
        return _CPU_SMS
    return _cuda_sms(_index(device))
