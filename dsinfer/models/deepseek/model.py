"""DeepseekV2ForCausalLM / DeepseekV3ForCausalLM / DeepseekV32ForCausalLM: MLA + MoE decoder, optional MTP draft
module, FP8 weights.

V2 and V3 differ only in defaults: V2 always ropes interleaved pairs and gates with softmax; V3 ropes
interleaved unless ``rope_interleave`` is false and gates with sigmoid + noaux_tc unless the config says
otherwise (transformers >= 5 writes V3 configs without ``scoring_func`` / ``topk_method``). V3.2 is V3 whose
attention layers attend only to the tokens their lightning indexer selects (``layers.indexer``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dsinfer.config import KernelConfig
from dsinfer.distributed.state import SINGLE, ParallelState
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.fp8_linear import Fp8Config
from dsinfer.layers.indexer import IndexedMLAAttention
from dsinfer.layers.mla import MLAAttention, fuses_q_kv_a
from dsinfer.layers.moe import SHARED, ExpertSlots, FusedExperts
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.streams import SideStream
from dsinfer.models.deepseek.blocks import (
    DeepseekDecoderLayer,
    DeepseekMoE,
    check_config,
    fused_shared_experts,
    is_moe_layer,
)
from dsinfer.models.stack import DecoderStack
from dsinfer.ops.fp8 import FP8_DTYPE

logger = logging.getLogger("dsinfer")

_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")
# the shared experts' MLP, when its chunks ride in the routed experts' stack (``blocks.fused_shared_experts``)
_SHARED = re.compile(r"\.shared_experts\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")
_STACKED = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}
_PACKED = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}
# q_a_proj (q LoRA) or q_proj (none) and kv_a_proj_with_mqa: one GEMM (``layers.mla.fuses_q_kv_a``)
_PACKED_QKV_A = {
    ".q_a_proj.": (".fused_qkv_a_proj.", 0),
    ".q_proj.": (".fused_qkv_a_proj.", 0),
    ".kv_a_proj_with_mqa.": (".fused_qkv_a_proj.", 1),
}
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.")


def _stacked(mlp: str, proj: str, tensor: str) -> str:
    """The stacked parameter of an expert projection's ``tensor`` (weight / weight_scale_inv) under ``mlp``."""
    return f"{mlp}.experts.{'w2' if proj == 'down' else 'w13'}{'_scale_inv' if tensor == 'weight_scale_inv' else ''}"


class DeepseekV2ForCausalLM(DecoderStack):
    # MLA takes its prefill path for steps of more than one token a sequence, which reads the step's sequence
    # lengths on the host: steps that verify drafts run eagerly (measured on the H200: their capture fails)
    multi_token_decode_graphs = False
    variant: dict[str, Any] = {
        "rope_is_neox": lambda cfg: False,  # V2 ropes interleaved pairs (the reference's complex multiply)
        "router": {"scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
                   "topk_methods": ("greedy", "group_limited_greedy")},
    }

    supports_tensor_parallel = True
    supports_expert_parallel = True  # routed experts partitioned over the EP ranks (``DeepseekMoE``)

    def __init__(self, cfg: dict[str, Any], kernel: KernelConfig | None = None, parallel: ParallelState = SINGLE,
                 expert_slots: ExpertSlots | None = None):
        """``kernel``: the engine's kernel choices (None: ``KernelConfig()``'s defaults); ``parallel``: this
        rank's tensor-parallel state (attention heads, every MLP's and expert's intermediate columns and the
        vocabulary split across its ranks); ``expert_slots``: the MoE layers' redundant and spare slots under
        EPLB (None: none)."""
        super().__init__()
        check_config(cfg)
        cfg.setdefault("rms_norm_eps", 1e-6)
        kernel = kernel or KernelConfig()
        self.cfg, self.quant = cfg, Fp8Config.from_hf(cfg)
        # under expert parallelism the shared experts stay a tensor-parallel MLP beside the partitioned experts
        self.fuses_shared_experts = fused_shared_experts(cfg, self.quant, kernel.fuse_shared_experts
                                                         and not parallel.expert_parallel) > 0
        # one side stream for every layer that overlaps work in CUDA graphs (streams made on first use)
        self.side_stream = SideStream() if kernel.side_stream else None
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"], parallel)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, self.quant, self.variant, kernel, self.side_stream, parallel, expert_slots)
            for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = LMHead(cfg["vocab_size"], cfg["hidden_size"], self.embed_tokens if tied else None, parallel)
        self.mtp = None
        if cfg.get("num_nextn_predict_layers"):
            from dsinfer.models.mtp import DeepseekMTP

            self.mtp = DeepseekMTP(cfg, self.quant, self.variant, kernel, self.side_stream, parallel, expert_slots)

    def moe_blocks(self) -> list[DeepseekMoE]:
        """The MoE blocks in layer order: the main model's, then the MTP layers' (EPLB balances them all)."""
        layers = [*self.layers, *(layer.block for layer in self.mtp.layers)] if self.mtp is not None else self.layers
        return [layer.mlp for layer in layers if isinstance(layer.mlp, DeepseekMoE)]

    def attention_layers(self) -> list[MLAAttention]:
        """The main model's MLA layers (the MTP module's own layers are ``self.mtp.attention_layers()``)."""
        return [layer.self_attn for layer in self.layers]

    # ---- weights -------------------------------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Checkpoint tensor name -> (our parameter name, shard id or None); None to skip the tensor."""
        if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and self.lm_head.tied):
            return None
        name = name.removeprefix("model.")
        match = re.match(r"layers\.(\d+)\.(.*)", name)
        if match and int(match[1]) >= self.cfg["num_hidden_layers"]:  # an MTP layer
            index = int(match[1]) - self.cfg["num_hidden_layers"]
            if self.mtp is None or index >= len(self.mtp.layers):
                return None
            rest = match[2] if match[2].startswith(_MTP_OWN) else f"block.{match[2]}"
            name = f"mtp.layers.{index}.{rest}"
        expert = _EXPERT.search(name)
        if expert:
            return _stacked(name[: expert.start()], expert[2], expert[3]), (int(expert[1]), expert[2])
        shared = _SHARED.search(name) if self.fuses_shared_experts else None
        if shared:
            return _stacked(name[: shared.start()], shared[1], shared[2]), (SHARED, shared[1])
        for fragment, ours in _STACKED.items():
            if name.endswith(fragment):
                return name[: -len(fragment)] + ours, None
        for fragment, (merged, shard) in _PACKED.items():
            if fragment in name:
                return name.replace(fragment, merged), shard
        if fuses_q_kv_a(self.cfg):
            for fragment, (merged, shard) in _PACKED_QKV_A.items():
                if fragment in name:
                    return name.replace(fragment, merged), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route each checkpoint tensor to its parameter (via its ``weight_loader``); all must be filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            routed = self.checkpoint_name(ckpt_name)
            if routed is None:
                continue
            name, shard = routed
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} has no matching parameter ({name!r}) in the model"
                )
            if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} is FP8 but config.json has no fp8 "
                    "quantization_config (weight_block_size) to dequantize it with"
                )
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
            elif param.shape != tensor.shape:
                raise ValueError(
                    f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                )
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        if self.mtp is not None and not any(name.startswith("mtp.") for name in loaded):
            logger.info("the checkpoint has no MTP layer weights: the MTP draft module is dropped")
            self.mtp = None
            params = dict(self.named_parameters())
        missing = sorted(set(params) - loaded)
        missing += [f"{prefix.removesuffix('.experts')}.{part}" for prefix, module in self.named_modules()
                    if isinstance(module, FusedExperts) for part in module.missing_shards()]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameter(s), e.g. {missing[:5]}")

    def post_load(self) -> None:
        """After real or dummy weights: FP8 layers dequantize where they must."""
        for module in self.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    variant: dict[str, Any] = {
        "rope_is_neox": lambda cfg: cfg.get("rope_interleave") is False,
        "router": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                   "topk_methods": ("noaux_tc",)},
    }


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """V3 with DeepSeek sparse attention: every layer's MLA attends to its indexer's top ``index_topk`` tokens.
    transformers ropes V3.2's MLA interleaved whatever the config says (it has no ``rope_interleave``)."""

    variant: dict[str, Any] = {
        **DeepseekV3ForCausalLM.variant,
        "rope_is_neox": lambda cfg: False,
        "attention": IndexedMLAAttention,
    }
    supports_tensor_parallel = False  # the indexer's heads are not split yet
    supports_expert_parallel = False

    def __init__(self, cfg: dict[str, Any], kernel: KernelConfig | None = None,
                 expert_slots: ExpertSlots | None = None):
        types = cfg.get("mlp_layer_types")
        ours = ["sparse" if is_moe_layer(cfg, i) else "dense" for i in range(cfg.get("num_hidden_layers") or 0)]
        if types is not None and list(types) != ours:
            raise ValueError(f"mlp_layer_types={types} is not supported: the MoE layers are those from "
                             f"first_k_dense_replace={cfg.get('first_k_dense_replace')} on ({ours})")
        super().__init__(cfg, kernel, expert_slots=expert_slots)
