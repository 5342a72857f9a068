"""DeepSeek-V4 (hyper-connections, CSA / HCA compressed attention, hash and top-k MoE)."""

from dsinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]
