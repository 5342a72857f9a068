"""DeepSeek-V2/V3 (MLA, MoE, MTP, FP8 block weights)."""

from dsinfer.models.deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
