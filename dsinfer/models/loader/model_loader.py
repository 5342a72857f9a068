"""Build the model for a config and fill its weights (checkpoint or dummy) on the target device and dtype."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dsinfer.config import EngineConfig
from dsinfer.distributed.state import SINGLE, ParallelState
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


def build_model(config: EngineConfig, parallel: ParallelState = SINGLE) -> nn.Module:
    """The model class of ``config`` built (weights uninitialized) on the current default device; ``parallel``:
    this rank's tensor- (and expert-) parallel state. A model class without ``supports_tensor_parallel`` is
    refused at more than one rank, one without ``supports_expert_parallel`` with expert parallelism; a size the
    ranks do not divide is the layers' ValueError."""
    cls = model_class(config.model.architecture)
    extra = {}
    if config.parallel.enable_eplb:  # the MoE layers' redundant and spare slots (``layers.moe.ExpertSlots``)
        extra["expert_slots"] = ExpertSlots(config.parallel.eplb_config.num_redundant_experts, SPARE_SLOTS)
    if parallel.tp_size == 1 and not parallel.expert_parallel:
        return cls(dict(config.model.hf_config), config.kernel, **extra)
    if parallel.tp_size > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{config.model.architecture} does not support tensor_parallel_size > 1 yet (got "
                         f"{parallel.tp_size}); supported: Llama, Qwen2, Qwen3, Mistral, GPT-OSS, DeepSeek-V2/V3")
    if parallel.expert_parallel and not getattr(cls, "supports_expert_parallel", False):
        raise ValueError(f"enable_expert_parallel=True needs a DeepSeek V2 / V3 MoE model; "
                         f"{config.model.architecture} has no routed experts dsinfer partitions over ranks")
    return cls(dict(config.model.hf_config), config.kernel, parallel, **extra)


def check_parallel_shapes(config: EngineConfig) -> None:
    """Build the model on the meta device as one of the tensor-parallel ranks (and of the expert-parallel group,
    when enabled): the sizes that do not split (heads, key/value heads, intermediate sizes, vocabulary, physical
    experts over the EP ranks) fail here, as ValueErrors naming them, before any process starts or any weight
    loads."""
    parallel = config.parallel
    shapes = ParallelState(tp_size=parallel.tensor_parallel_size, ep_size=parallel.expert_parallel_size,
                           dp_size=parallel.data_parallel_size if parallel.enable_expert_parallel else 1)
    with _default_dtype_and_device(config.model.dtype, torch.device("meta")):
        build_model(config, shapes)


def load_model(config: EngineConfig, parallel: ParallelState = SINGLE) -> nn.Module:
    """The model of ``config``, built with its ``KernelConfig`` (whose process-wide kernel options are set here,
    once, before any forward: ``ops.options.configure``); ``parallel``: this rank's tensor-parallel state (each
    weight loader keeps this rank's slice)."""
    options.configure(config.kernel)
    with _default_dtype_and_device(config.model.dtype, config.device.device):
        model = build_model(config, parallel)
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
