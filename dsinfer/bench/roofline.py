"""Roofline floors from the model and the measured ceilings (``ceilings.py``): what a decode step must read and
what a prefill must compute, and the floor of a whole offline run.

* decode: (weight bytes the step touches + KV bytes read) / copy bandwidth. Weights touched: everything but the
  embedding table (only B rows of it are read) and the MTP module; of the routed experts only the distinct experts
  the batch picks, E (1 - (1 - k/E)^B) under uniform routing (or counted from a real step's router outputs). KV:
  each sequence's context x bytes per token (DeepSeek-V4: ``v4_kv_read_bytes``);
* prefill: FLOPs (2 x the matmul parameters each token multiplies x tokens, of the routed experts only top_k, +
  causal attention, + the lm_head on each prompt's last token) / matmul rate (FP8 weights at the FP8 rate);
* an offline run (``run_floor``, ``dsinfer bench throughput``): every prompt's prefill at the matmul rate plus
  the decode steps of continuous batching at ``max_num_seqs`` (each request's first token comes from its prefill,
  every later one from a decode step) at the bandwidth. The two are added, as an engine that does not overlap a
  prefill's compute with a decode's memory traffic spends them. Its KV term is context x bytes per token (a
  DeepSeek-V4 run's compressed caches read less: its floor there is too high).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WeightShape:
    """What a decode step reads of the weights and what each token multiplies in a prefill (from the model)."""

    always_bytes: int  # read by every decode step: attention, dense MLPs, shared experts, routers, norms, lm_head
    expert_bytes: list[int] = field(default_factory=list)  # bytes of one routed expert, per MoE layer
    num_experts: int = 0
    top_k: int = 0
    matmul_params: int = 0  # parameters each token multiplies in the model dtype (decoder layers)
    fp8_matmul_params: int = 0  # the same for FP8 block-scaled weights
    lm_head_params: int = 0

    @property
    def moe_layers(self) -> int:
        return len(self.expert_bytes)


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts B tokens hit, each picking top_k distinct experts uniformly."""
    if not num_experts:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_weight_bytes(shape: WeightShape, batch: int, touched: list[float] | None = None) -> float:
    """Weight bytes one decode step of ``batch`` sequences touches; ``touched``: distinct experts per MoE layer
    (default: the expectation under uniform routing)."""
    if touched is None:
        touched = [expected_distinct_experts(shape.num_experts, shape.top_k, batch)] * shape.moe_layers
    if len(touched) != shape.moe_layers:
        raise ValueError(f"{len(touched)} expert counts for {shape.moe_layers} MoE layers")
    return shape.always_bytes + sum(n * b for n, b in zip(touched, shape.expert_bytes))


def decode_floor_ms(shape: WeightShape, batch: int, context: int, kv_bytes_per_token: int, bandwidth: float,
                    touched: list[float] | None = None, kv_bytes_per_seq: float | None = None) -> float:
    """(weights touched + latent/KV bytes read) / bandwidth, in ms; ``kv_bytes_per_seq``: what one sequence's
    step reads of its cache, where that is not context x bytes per token (DeepSeek-V4)."""
    kv = batch * (context * kv_bytes_per_token if kv_bytes_per_seq is None else kv_bytes_per_seq)
    return (decode_weight_bytes(shape, batch, touched) + kv) / bandwidth * 1e3


def v4_kv_read_bytes(cfg: dict, context: int, itemsize: int) -> int:
    """Cache bytes one DeepSeek-V4 decode step of one sequence with ``context`` tokens before it must read: every
    layer its window's keys before the token (window - 1 of them); an HCA layer every entry (context // rate
    x head_dim); a CSA layer its indexer's keys of every entry (context // rate x index_head_dim) and the
    entries the indexer picks (min(index_topk, context // rate) x head_dim). The compressors' rings are read once
    a window closes (every rate steps) and are left out."""
    from dsinfer.models.deepseek_v4.config import CSA, HCA, V4Config

    v4 = V4Config.of(cfg)
    total = 0
    for kind in v4.layer_types:
        total += min(context, v4.sliding_window - 1) * v4.head_dim
        entries = context // v4.compress_rates[kind] if kind in (CSA, HCA) else 0
        if kind == HCA:
            total += entries * v4.head_dim
        elif kind == CSA:
            total += entries * v4.index_head_dim + min(v4.index_topk, entries) * v4.head_dim
    return total * itemsize


def is_v4(cfg: dict) -> bool:
    return cfg.get("architectures", [""])[0] == "DeepseekV4ForCausalLM"


def v4_attention_flops(cfg: dict, num: int, length: int) -> float:
    """Causal DeepSeek-V4 attention FLOPs of ``num`` prompts of ``length`` tokens: each query's window keys and
    compressed entries (HCA: all it sees; CSA: the top-k, plus the indexer's scores of all it sees), QK^T and PV
    over head_dim (K is V)."""
    import torch

    from dsinfer.models.deepseek_v4.config import CSA, HCA, V4Config

    v4 = V4Config.of(cfg)
    t = torch.arange(1, length + 1, dtype=torch.float64)  # tokens each query sees
    flops = 0.0
    for kind in v4.layer_types:
        keys = t.clamp(max=v4.sliding_window)
        if kind in (CSA, HCA):
            seen = torch.div(t, v4.compress_rates[kind], rounding_mode="floor")
            keys = keys + (seen.clamp(max=v4.index_topk) if kind == CSA else seen)
            if kind == CSA:
                flops += float(2 * v4.index_n_heads * v4.index_head_dim * seen.sum())
        flops += float(2 * 2 * v4.head_dim * v4.num_heads * keys.sum())
    return flops * num


def attention_flops(cfg: dict, num: int, length: int) -> float:
    """Causal attention FLOPs of ``num`` prompts of ``length`` tokens (QK^T and PV; MLA with expanded K/V)."""
    if is_v4(cfg):
        return v4_attention_flops(cfg, num, length)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):
        qk, v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    else:
        qk = v = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * (qk + v) * heads * layers * num * length * (length + 1) / 2


def prefill_floor_ms(shape: WeightShape, cfg: dict, num: int, length: int, matmul_rate: float,
                     fp8_rate: float | None = None) -> tuple[float, float]:
    """(floor ms, FLOPs) of a prefill of ``num`` x ``length`` tokens; the lm_head runs on the last token only."""
    tokens = num * length
    flops = 2 * shape.matmul_params * tokens + attention_flops(cfg, num, length) + 2 * shape.lm_head_params * num
    fp8_flops = 2 * shape.fp8_matmul_params * tokens
    seconds = flops / matmul_rate + (fp8_flops / (fp8_rate or matmul_rate) if fp8_flops else 0.0)
    return seconds * 1e3, flops + fp8_flops


def v4_weight_shape(model: Any) -> WeightShape:
    """``weight_shape`` of a DeepSeek-V4 model: its routed experts (``V4Experts``) per MoE layer; every step reads
    the rest but the embedding table and the hash-routing tables (B rows of each)."""
    from dsinfer.layers.linear import Linear
    from dsinfer.models.deepseek_v4.moe import V4Experts, V4Router

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    experts = [m for m in model.layers.modules() if isinstance(m, V4Experts)]
    routers = [m for m in model.layers.modules() if isinstance(m, V4Router)]
    expert_params = {id(p) for m in experts for p in m.parameters()}
    embed, tied = model.embed.weight, model.head.tied
    always = [p for name, p in model.named_parameters() if id(p) not in expert_params
              and (p is not embed or tied) and not name.endswith("tid2eid")]
    per_expert = [nbytes(m.parameters()) // m.w13.shape[0] for m in experts]
    top_k = routers[0].top_k if routers else 0
    shape = WeightShape(always_bytes=nbytes(always), expert_bytes=per_expert,
                        num_experts=experts[0].w13.shape[0] if experts else 0, top_k=top_k,
                        lm_head_params=model.head.weight.numel())
    for module in model.layers.modules():
        if isinstance(module, (Linear, V4Router)):
            shape.matmul_params += module.weight.numel()
        elif isinstance(module, V4Experts):
            shape.matmul_params += top_k * (module.w13.numel() + module.w2.numel()) // module.w13.shape[0]
    return shape


def weight_shape(model: Any) -> WeightShape:
    """Walk the model: bytes every step reads, bytes per routed expert, matmul parameters per token."""
    if is_v4(model.cfg):
        return v4_weight_shape(model)
    from dsinfer.layers.fp8_linear import Fp8BlockLinear
    from dsinfer.layers.linear import Linear
    from dsinfer.layers.moe import FusedExperts, Router

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    experts = {name: m for name, m in model.named_modules()
               if isinstance(m, FusedExperts) and not name.startswith("mtp.")}
    routers = [m for name, m in model.named_modules() if isinstance(m, Router) and not name.startswith("mtp.")]
    embed, tied = model.embed_tokens.weight, model.lm_head.tied
    expert_params = {id(p) for m in experts.values() for p in m.parameters()}
    always = [p for name, p in model.named_parameters()
              if not name.startswith("mtp.") and id(p) not in expert_params and (p is not embed or tied)]
    per_slot = [nbytes(m.parameters()) // m.num_experts for m in experts.values()]  # routed or shared: one size
    shared = sum(m.num_shared * b for m, b in zip(experts.values(), per_slot))  # fused shared experts: every step
    shape = WeightShape(always_bytes=nbytes(always) + shared, expert_bytes=per_slot,
                        num_experts=routers[0].cfg.num_experts if routers else 0,
                        top_k=routers[0].cfg.top_k if routers else 0,
                        lm_head_params=model.lm_head.weight.numel())
    for module in model.layers.modules():
        if isinstance(module, Fp8BlockLinear):
            if module.dense is None:
                shape.fp8_matmul_params += module.weight.numel()
            else:
                shape.matmul_params += module.weight.numel()
        elif isinstance(module, (Linear, Router)):
            shape.matmul_params += module.weight.numel()
        elif isinstance(module, FusedExperts):
            per_slot = (module.w13.numel() + module.w2.numel()) // module.num_experts
            per_token = (shape.top_k + module.num_shared) * per_slot  # routed top-k + fused shared experts
            if module.quant and module.dense is None:
                shape.fp8_matmul_params += per_token
            else:
                shape.matmul_params += per_token
    return shape


def kv_read_bytes(model: Any, kv_bytes_per_token: int, context: int) -> int:
    """Cache bytes one sequence's decode step reads at ``context`` tokens (``model``: the runner's)."""
    if is_v4(model.cfg):
        itemsize = model.attention_layers()[0].state["window"].element_size()
        return v4_kv_read_bytes(model.cfg, context, itemsize)
    return context * kv_bytes_per_token


@dataclass(frozen=True)
class RunFloor:
    """The floor of an offline run, in seconds, and what it counts."""

    prefill_s: float  # the prompts' FLOPs at the matmul rate(s)
    decode_s: float  # the decode steps' weight and KV bytes at the bandwidth
    prefill_flops: float
    decode_weight_bytes: float
    decode_kv_bytes: float
    decode_steps: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def fraction(self, elapsed_s: float) -> float:
        """The share of the roofline a run of ``elapsed_s`` reached: floor / measured (1.0: at the floor)."""
        return self.total_s / elapsed_s


def decode_batches(output_lens: list[int], max_num_seqs: int) -> list[int]:
    """The batch of each decode step of continuous batching: requests join in order as slots free up (at most
    ``max_num_seqs`` at once) and each needs ``output_len - 1`` decode steps (its first token is its prefill's)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    waiting = [n - 1 for n in output_lens if n > 1][::-1]
    running: list[int] = []  # the step each running request finishes after
    batches: list[int] = []
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            heapq.heappush(running, len(batches) + waiting.pop())
        batches.append(len(running))
        while running and running[0] <= len(batches):
            heapq.heappop(running)
    return batches


def run_floor(shape: WeightShape, cfg: dict, kv_bytes_per_token: int, input_len: int, output_lens: list[int],
              max_num_seqs: int, bandwidth: float, matmul_rate: float,
              fp8_rate: float | None = None) -> RunFloor:
    """The floor of ``len(output_lens)`` prompts of ``input_len`` tokens each generating its output length."""
    prefill_ms, flops = prefill_floor_ms(shape, cfg, len(output_lens), input_len, matmul_rate, fp8_rate)
    batches = decode_batches(output_lens, max_num_seqs)
    weights = sum(decode_weight_bytes(shape, b) for b in batches)
    # the decode step making token t (1-based) of a request reads the KV of its input_len + t - 1 tokens
    kv = kv_bytes_per_token * sum((n - 1) * input_len + (n - 1) * n // 2 for n in output_lens if n > 1)
    return RunFloor(prefill_ms / 1e3, (weights + kv) / bandwidth, flops, weights, kv, len(batches))


def describe_model(shape: WeightShape, cfg: dict, dtype: Any, kv_bytes_per_token: int) -> str:
    """Which model the floors are of: architecture, layers, dtype, the bytes a decode step reads."""
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    text = (f"model {cfg.get('architectures', ['?'])[0]}, {cfg['num_hidden_layers']} layers, {dtype}"
            f"{', weights ' + quant if quant else ''}; decode reads {shape.always_bytes / 1e9:.2f} GB always")
    if shape.moe_layers:
        text += (f" + {shape.expert_bytes[0] / 1e6:.1f} MB per routed expert x {shape.moe_layers} MoE layers "
                 f"(top {shape.top_k} of {shape.num_experts})")
    return text + f"; KV {kv_bytes_per_token} B/token"


def throughput_roofline(llm, ceilings, input_len: int, output_lens: list[int], elapsed_s: float) -> dict:
    """The roofline figures of an offline run of ``llm`` that took ``elapsed_s`` (``dsinfer bench throughput``)."""
    engine = llm.engine
    runner = engine.runner
    shape = weight_shape(runner.model)
    floor = run_floor(shape, runner.model.cfg, runner.kv_bytes_per_token, input_len, output_lens,
                      engine.config.scheduler.max_num_seqs, ceilings.bandwidth, ceilings.matmul_rate,
                      ceilings.fp8_matmul_rate)
    return {"roofline_model": describe_model(shape, runner.model.cfg, engine.model_config.dtype,
                                             runner.kv_bytes_per_token),
            "roofline_device": ceilings.describe(), "roofline_floor_s": floor.total_s,
            "roofline_prefill_floor_s": floor.prefill_s, "roofline_decode_floor_s": floor.decode_s,
            "roofline_decode_steps": floor.decode_steps, "roofline_fraction": floor.fraction(elapsed_s)}
