"""DeepSeek-V4's config.json read once into a frozen view, with the legacy spellings folded in as transformers does.

Published checkpoints and transformers' ``save_pretrained`` write the same model two ways: per-layer
``compress_ratios`` (0 / 4 / 128) or ``layer_types``; ``compress_rate_csa`` / ``_hca`` or ``compress_rates``;
``num_hash_layers`` or ``mlp_layer_types``; ``qk_rope_head_dim`` or ``partial_rotary_factor``; flat
``rope_theta`` / ``compress_rope_theta`` / ``rope_scaling`` or ``rope_parameters`` nested by rope type (``main``
for sliding layers, ``compress`` for the compressed ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_RATES = {CSA: 4, HCA: 128}


def _rope_parameters(cfg: dict[str, Any], partial: float) -> dict[str, dict[str, Any]]:
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return {"main": dict(params["main"]), "compress": dict(params["compress"])}
    # flat form: the scaling (YaRN) applies to the compressed layers only, at compress_rope_theta; the V4
    # reference never multiplies cos / sin by YaRN's mscale, hence attention_factor 1
    scaling = {k: v for k, v in {**(cfg.get("rope_scaling") or {}), **params}.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": partial}
    compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    compress["rope_type"] = compress.get("rope_type") or compress.pop("type", None) or "default"
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


@dataclass(frozen=True)
class V4Config:
    """The fields the V4 model reads; ``of`` builds it from a config.json dict."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads; one shared KV head
    head_dim: int  # of q, of the shared K=V, of compressed entries
    rope_dim: int  # trailing rope channels of a head
    q_lora_rank: int
    o_groups: int  # grouped output projection: head groups
    o_lora_rank: int  # and each group's width
    sliding_window: int  # every layer's local branch: the last ``sliding_window`` tokens, the query's own included
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]  # per compressed layer type: source tokens per compressed entry
    mlp_layer_types: tuple[str, ...]  # "hash_moe" (tid2eid routing) or "moe" (top-k)
    index_n_heads: int
    index_head_dim: int
    index_topk: int  # compressed entries each query of a CSA layer attends to
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # routed and shared experts alike
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int  # hyper-connection residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_parameters: dict[str, dict[str, Any]]  # "main" and "compress"
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    # the MTP layers' attention and MoE kinds: what ``layer_types`` / ``mlp_layer_types`` list past the main layers
    # (the published ``compress_ratios`` has num_hidden_layers + 1 entries, its last one, 0, the MTP layer's), else
    # sliding attention and top-k MoE (the reference hashes only layers below ``num_hash_layers``)
    mtp_layer_types: tuple[str, ...] = ()
    mtp_mlp_layer_types: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> V4Config:
        n = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim", 512)
        rope_dim = cfg.get("qk_rope_head_dim")
        partial = cfg.get("partial_rotary_factor") or (rope_dim / head_dim if rope_dim else 64 / 512)
        layer_types = cfg.get("layer_types")
        if layer_types is None and cfg.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[r] for r in cfg["compress_ratios"]]
        if layer_types is None:  # transformers' default: two HCA layers, then CSA / HCA interleaved
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        rates = {**DEFAULT_RATES, **(cfg.get("compress_rates") or {})}
        for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if cfg.get(legacy) is not None:
                rates[kind] = cfg[legacy]
        n_mtp = cfg.get("num_nextn_predict_layers") or 0
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = cfg.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n + n_mtp, n_hash) + ["moe"] * max(0, n + n_mtp - n_hash)
        mtp_types = (list(layer_types[n:n + n_mtp]) + [SLIDING] * n_mtp)[:n_mtp]
        mtp_mlp_types = (list(mlp_types[n:n + n_mtp]) + ["moe"] * n_mtp)[:n_mtp]
        out = cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=n,
            num_heads=cfg["num_attention_heads"], head_dim=head_dim, rope_dim=int(head_dim * partial),
            q_lora_rank=cfg["q_lora_rank"], o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"],
            sliding_window=cfg["sliding_window"], layer_types=tuple(layer_types[:n]), compress_rates=rates,
            mlp_layer_types=tuple(mlp_types[:n]), index_n_heads=cfg["index_n_heads"],
            index_head_dim=cfg["index_head_dim"], index_topk=cfg["index_topk"],
            n_routed_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"], scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)), hc_mult=cfg.get("hc_mult", 4),
            hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20), hc_eps=float(cfg.get("hc_eps", 1e-6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_parameters=_rope_parameters(cfg, partial),
            num_nextn_predict_layers=n_mtp, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mtp_layer_types=tuple(mtp_types), mtp_mlp_layer_types=tuple(mtp_mlp_types),
        )
        out.check()
        return out

    def check(self) -> None:
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if len(self.layer_types) != self.num_layers or bad:
            raise ValueError(f"layer_types must name {self.num_layers} layers out of {LAYER_TYPES}, got "
                             f"{list(self.layer_types)}")
        bad = [t for t in self.mtp_layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"the MTP layers' types (past num_hidden_layers in layer_types / compress_ratios) must be "
                             f"out of {LAYER_TYPES}, got {list(self.mtp_layer_types)}")
        bad = [t for t in self.mlp_layer_types if t not in ("hash_moe", "moe")]
        if len(self.mlp_layer_types) != self.num_layers or bad:
            raise ValueError(f"mlp_layer_types must name {self.num_layers} layers out of ('hash_moe', 'moe'), got "
                             f"{list(self.mlp_layer_types)}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"num_attention_heads * head_dim ({self.num_heads * self.head_dim}) must divide into "
                             f"o_groups={self.o_groups}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim or self.rope_dim > self.index_head_dim:
            raise ValueError(f"the rope dims ({self.rope_dim}) must be even and fit head_dim ({self.head_dim}) and "
                             f"index_head_dim ({self.index_head_dim})")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported; supported: sqrtsoftplus, "
                             "sigmoid, softmax")
        for kind, rate in self.compress_rates.items():
            if not isinstance(rate, int) or rate < 1:
                raise ValueError(f"compress_rates[{kind!r}] must be a positive integer, got {rate!r}")

    def rate(self, layer: int) -> int:
        """Source tokens per compressed entry of ``layer`` (0: a sliding layer, no compressor)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @property
    def max_rate(self) -> int:
        """The largest compression rate a layer uses, the MTP layers' too (1 when every layer is sliding)."""
        return max([self.with_mtp_layers().rate(i) for i in range(self.num_layers + self.num_nextn_predict_layers)]
                   + [1])

    def with_mtp_layers(self) -> V4Config:
        """This config with the MTP layers appended as layers ``num_layers ..`` (what builds their blocks)."""
        return replace(self, num_layers=self.num_layers + len(self.mtp_layer_types),
                       layer_types=self.layer_types + self.mtp_layer_types,
                       mlp_layer_types=self.mlp_layer_types + self.mtp_mlp_layer_types, mtp_layer_types=(),
                       mtp_mlp_layer_types=(), num_nextn_predict_layers=0)
