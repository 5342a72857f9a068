"""DeepSeek-V2/V3/V3.2 (MLA, MoE, MTP, FP8 block weights; V3.2: the lightning indexer and sparse MLA)."""

from dsinfer.models.deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"]
