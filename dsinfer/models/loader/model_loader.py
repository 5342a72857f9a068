"""Build the model for a config and fill its weights (checkpoint or dummy) on the target device and dtype."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dsinfer.config import EngineConfig
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


def load_model(config: EngineConfig) -> nn.Module:
    """The model of ``config``, built with its ``KernelConfig`` (whose process-wide kernel options are set here,
    once, before any forward: ``ops.options.configure``)."""
    options.configure(config.kernel)
    cls = model_class(config.model.architecture)
    with _default_dtype_and_device(config.model.dtype, config.device.device):
        model = cls(dict(config.model.hf_config), config.kernel)
    quantization = config.model.quantization
    if quantization is not None:
        from dsinfer.layers.quant import attach_cpu_quantization

        attach_cpu_quantization(model, quantization)
    if config.load.load_format == "dummy":
        init_dummy_weights(model, float(config.model.hf_config.get("initializer_range", 0.02)), config.load.seed)
    else:
        with torch.device(config.device.device):
            model.load_weights(_checkpoint(config))
    if quantization is not None:
        from dsinfer.layers.quant import finish_cpu_quantization

        finish_cpu_quantization(model)
    if hasattr(model, "post_load"):  # after real or dummy weights alike
        model.post_load()
    return model.eval()


def _checkpoint(config: EngineConfig):
    """The checkpoint's (name, tensor) pairs: the GGUF's quantized packs where ``quantized_weights`` names them."""
    if config.model.quantized_weights is not None:
        from dsinfer.models.loader.gguf_quant import iterate_quantized

        return iterate_quantized(config.model.quantized_weights)
    return iterate_safetensors(config.model.path)
