"""What a runner may allocate: the GPU share of ``gpu_memory_utilization``, the weights' fit before loading, and
the KV cache's byte budget."""

from __future__ import annotations

import itertools

import torch

from dsinfer import envs
from dsinfer.config import EngineConfig
from dsinfer.distributed.state import ParallelState
from dsinfer.models.loader.model_loader import _default_dtype_and_device, build_model

GiB = 1 << 30


def memory_left_to_take(free: int, total: int, own: int, utilization: float) -> int:
    """Bytes this process may still allocate on its GPU: its share (``utilization`` x total) less what it holds
    (``own``: torch's reserved bytes), never more than is free. Other processes' memory is not charged to this
    one's share, as in vLLM: two replicas at 0.45 share one GPU whichever starts first."""
    return min(int(total * utilization) - own, free)


def check_weights_fit(config: EngineConfig, parallel: ParallelState) -> None:
    """Fail before loading when the weights alone (this rank's slice) exceed what gpu_memory_utilization allows,
    saying by how much."""
    try:
        with _default_dtype_and_device(config.model.dtype, torch.device("meta")):
            meta = build_model(config, parallel.for_shapes())
    except Exception:  # a model that cannot be built on the meta device: loading will tell
        return
    weight_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(meta.parameters(), meta.buffers()))
    free, total = torch.cuda.mem_get_info(config.device.device)
    util = config.cache.gpu_memory_utilization
    allowed = memory_left_to_take(free, total, torch.cuda.memory_reserved(config.device.device), util)
    if weight_bytes > allowed:
        raise ValueError(
            f"the model does not fit: its weights need {weight_bytes / GiB:.2f} GiB, but "
            f"gpu_memory_utilization={util} of {total / GiB:.1f} GiB with {free / GiB:.1f} GiB free leaves "
            f"{allowed / GiB:.2f} GiB: short by {(weight_bytes - allowed) / GiB:.2f} GiB (before any KV cache); "
            "raise gpu_memory_utilization, free GPU memory or pick a smaller model or dtype")


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes the KV cache may take: ``kv_cache_memory_gb`` when set, ``DSINFER_CPU_KV_CACHE_GB`` on CPU, else
    this process's share of the GPU (``gpu_memory_utilization``) less what it holds and an activation reserve."""
    cache = config.cache
    if cache.kv_cache_memory_gb is not None:
        return int(cache.kv_cache_memory_gb * GiB)
    if device.type == "cpu":
        return int(envs.CPU_KV_CACHE_GB.get() * GiB)
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    activation_reserve = 2 * GiB  # logits, activations of the largest step, CUDA graphs
    budget = memory_left_to_take(free, total, own, cache.gpu_memory_utilization) - activation_reserve
    if budget <= 0:
        raise ValueError(
            f"the model leaves no room for a KV cache: this process holds {own / GiB:.1f} GiB and "
            f"{free / GiB:.1f} GiB are free of {total / GiB:.1f} GiB; gpu_memory_utilization="
            f"{cache.gpu_memory_utilization} allows {total * cache.gpu_memory_utilization / GiB:.1f} GiB; short "
            f"by {-budget / GiB:.1f} GiB")
    return budget
