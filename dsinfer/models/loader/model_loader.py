"""Build the model for a config and fill its weights (checkpoint or dummy) on the target device and dtype."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dsinfer.config import EngineConfig
from dsinfer.layers.moe import ExpertSlots
from dsinfer.models.registry import model_class
from dsinfer.models.weights import init_dummy_weights, iterate_safetensors
from dsinfer.ops import options


@contextlib.contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device):
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)


# storage slots per MoE layer outside the maps under EPLB: a rebalance copies one replica per layer at a time
# into one (bounded extra memory: one expert per layer), switches, and frees the slot it replaced
SPARE_SLOTS = 1


def load_model(config: EngineConfig) -> nn.Module:
    """The model of ``config``, built with its ``KernelConfig`` (whose process-wide kernel options are set here,
    once, before any forward: ``ops.options.configure``)."""
    options.configure(config.kernel)
    cls = model_class(config.model.architecture)
    extra = {}
    if config.parallel.enable_eplb:  # the MoE layers' redundant and spare slots (``layers.moe.ExpertSlots``)
        extra["expert_slots"] = ExpertSlots(config.parallel.eplb_config.num_redundant_experts, SPARE_SLOTS)
    with _default_dtype_and_device(config.model.dtype, config.device.device):
        model = cls(dict(config.model.hf_config), config.kernel, **extra)
    if config.load.load_format == "dummy":
        init_dummy_weights(model, float(config.model.hf_config.get("initializer_range", 0.02)), config.load.seed)
    else:
        with torch.device(config.device.device):
            model.load_weights(iterate_safetensors(config.model.path))
    if hasattr(model, "post_load"):  # after real or dummy weights alike
        model.post_load()
    return model.eval()
