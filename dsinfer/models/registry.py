"""Model classes registered by the ``architectures`` name of config.json, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("dsinfer.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("dsinfer.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("dsinfer.models.llama", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("dsinfer.models.llama", "MistralForCausalLM"),
    "DeepseekV2ForCausalLM": ("dsinfer.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("dsinfer.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("dsinfer.models.deepseek", "DeepseekV32ForCausalLM"),
    "DeepseekV4ForCausalLM": ("dsinfer.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "GptOssForCausalLM": ("dsinfer.models.gpt_oss", "GptOssForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
