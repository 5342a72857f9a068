"""DeepseekV4ForCausalLM: hyper-connected decoder layers of V4 attention and MoE, on the compressed cache.

Parameters are named as the published checkpoint names its tensors (``embed``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.E.w1``, ``hc_head_fn``...); ``checkpoint_name`` also reads what transformers'
``save_pretrained`` writes (a ``model.`` prefix and a few of transformers' own names). FP8 / FP4 weights are
dequantized as they load (``quant``). The MTP layers' tensors (``mtp.{k}.*``) load into ``self.mtp``
(``deepseek_v4.mtp``), which drafts for speculative decoding (``speculative_config={"method": "mtp"}``).

The model's last hidden state is its ``hc_mult`` residual streams [T, hc, D] (what the MTP layer reads);
``compute_logits`` collapses them (``hc_head``, ``norm``) and projects.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dsinfer.config import KernelConfig
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.layers.embedding import LMHead, VocabEmbedding
from dsinfer.layers.norm import RMSNorm
from dsinfer.models.deepseek_v4.attention import V4Attention
from dsinfer.models.deepseek_v4.config import V4Config
from dsinfer.models.deepseek_v4.hyper import HyperConnection, HyperHead
from dsinfer.models.deepseek_v4.moe import V4Experts, V4MoE
from dsinfer.models.deepseek_v4.quant import dequantized

# the attention's KV norm: ``attn.kv_norm`` as DeepSeek's reference names it (the published checkpoints),
# ``attn.norm`` as transformers' save_pretrained writes it back
_KV_NORM = ".attn.kv_norm."
# transformers' save_pretrained names -> the published ones (after the "model." prefix is dropped)
_SAVED_NAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
# published hyper-connection tensors -> our modules' parameters
_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MTP = re.compile(r"mtp\.(\d+)\.(.*)")

logger = logging.getLogger("dsinfer")


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, max_position: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn = V4Attention(cfg, layer, max_position)
        self.ffn = V4MoE(d, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                         cfg.vocab_size, cfg.mlp_layer_types[layer] == "hash_moe", cfg.scoring_func,
                         cfg.routed_scaling_factor, cfg.swiglu_limit)
        self.attn_norm, self.ffn_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        hc = (d, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        streams = HyperConnection.merge(self.attn(self.attn_norm(x), positions, batch), post, comb, streams)
        post, comb, x = self.hc_ffn(streams)
        static = self.attn.batched(batch)  # a decode step: the MoE's host-read-free path too
        return HyperConnection.merge(self.ffn(self.ffn_norm(x), input_ids, static), post, comb, streams)


class DeepseekV4ForCausalLM(nn.Module):
    # Decode steps (the same q tokens per sequence: 1, or 1 + drafts) take the batched path (``decode``) and the
    # MoE's static / Triton path: no host read, shapes from (batch, q, max_seq_len) only, state slots from the
    # batch, so the runner captures them in its decode graphs, multi-token ones too (``DecodeGraphs``' state slot
    # buffer). Prompt steps read their sequences' bounds on the host (``step.V4Step``): no piecewise prefill graphs
    # and no dummy-batch warm-up (those batches carry no state slots). The deterministic mode keeps the
    # per-sequence path for every step (``V4Attention.batched``), so it runs eagerly.
    eager_only = False
    prompt_graphs = False
    eager_when_deterministic = True
    multi_token_decode_graphs = True

    def __init__(self, cfg: dict[str, Any], kernel: KernelConfig | None = None):
        """``kernel``: unused (V4 runs its torch path); taken for the loader's common signature."""
        super().__init__()
        self.cfg = cfg
        self.v4 = v4 = V4Config.of(cfg)
        max_position = cfg.get("max_position_embeddings", 1 << 20)
        d = v4.hidden_size
        self.embed = VocabEmbedding(v4.vocab_size, d)
        self.layers = nn.ModuleList(V4DecoderLayer(v4, i, max_position) for i in range(v4.num_layers))
        self.hc_head = HyperHead(d, v4.hc_mult, v4.hc_eps, v4.rms_norm_eps)
        self.norm = RMSNorm(d, v4.rms_norm_eps)
        self.head = LMHead(v4.vocab_size, d, self.embed if v4.tie_word_embeddings else None)
        self.mtp = None
        if v4.num_nextn_predict_layers:
            from dsinfer.models.deepseek_v4.mtp import V4MTP

            self.mtp = V4MTP(v4, max_position, self.embed, self.head)

    def attention_layers(self) -> list[V4Attention]:
        """The main model's attention layers (the MTP layers' are ``self.mtp.attention_layers()``)."""
        return [layer.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """-> the last layer's streams [T, hc, D]."""
        x = self.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, batch)
        return streams

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Streams [T, hc, D] (``forward``'s) -> logits [T, vocab]."""
        return self.head(self.norm(self.hc_head(hidden)), upcast)

    # ---- weights -------------------------------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> tuple[str, tuple[int, str] | None] | None:
        """Checkpoint tensor name -> (our parameter or buffer name, (expert, w1/w2/w3) for an expert's slice);
        None for a tensor not ours (a tied head; an MTP layer's copy of the shared embedding or head; an MTP layer
        the config does not count)."""
        name = name.removeprefix("model.")
        name = _SAVED_NAMES.get(name, name)
        mtp = _MTP.match(name)
        if mtp:
            if self.mtp is None or int(mtp[1]) >= len(self.mtp.layers) or mtp[2].startswith(("embed.", "head.")):
                return None
            name = f"mtp.layers.{mtp[1]}.{mtp[2]}"
        if name == "head.weight" and self.head.tied:
            return None
        name = _HC.sub(lambda m: f"{m[1]}hc_{m[2]}.{m[3]}", name).replace(_KV_NORM, ".attn.norm.")
        expert = _EXPERT.search(name)
        if expert:
            return name[:expert.start()] + ".experts", (int(expert[1]), expert[2])
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter and buffer from the checkpoint (bf16 / fp32 safetensors, FP8 / FP4 weights
        dequantized: ``quant``); all must be filled."""
        targets = dict(self.named_parameters()) | dict(self.named_buffers())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for ckpt_name, tensor in dequantized(weights):
            routed = self.checkpoint_name(ckpt_name)
            if routed is None:
                continue
            name, shard = routed
            if shard is not None:
                experts = modules.get(name)
                if experts is None:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching experts ({name!r})")
                target, label = experts.target(*shard), f"{name}.{shard[0]}.{shard[1]}"
            else:
                if name not in targets:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter ({name!r})")
                target, label = targets[name].data, name
            if target.shape != tensor.shape:
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(label)
        if self.mtp is not None and not any(label.startswith("mtp.") for label in loaded):
            logger.info("the checkpoint has no MTP layer weights: the MTP draft module is dropped")
            self.mtp = None
            targets = dict(self.named_parameters()) | dict(self.named_buffers())
            modules = dict(self.named_modules())
        expected = {n for n in targets if not n.endswith("inv_freq")
                    and not isinstance(modules[n.rsplit(".", 1)[0]], V4Experts)}
        for prefix, module in modules.items():
            if isinstance(module, V4Experts):
                expected |= {f"{prefix}.{e}.{w}" for e in range(module.w13.shape[0]) for w in ("w1", "w2", "w3")}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")

