"""Decode step time vs batch size at a fixed context, prefill time vs length, and GPU idle between engine steps.

    python benchmarks/latency.py [--model benchmarks/configs/llama-3.1-8b] [--batch-sizes 1 64 256]
                                 [--context 1024] [--prefill 512 2048 8x2048] [--idle-batch 256] [--json-out F]
    python benchmarks/latency.py --model benchmarks/configs/deepseek-v3 \\
        --hf-overrides '{"num_hidden_layers": 5, "first_k_dense_replace": 3, "num_nextn_predict_layers": 0}'
    python benchmarks/latency.py --model benchmarks/configs/deepseek-v4-flash-4l --batch-sizes 1 64 256 \
        --context 16384 --max-model-len 16512 --prefill --idle-batch 0

Dummy weights at the config's real shapes (normal, std = initializer_range, like transformers' init, so MoE routing
spreads over the experts), bf16 on CUDA; a config with an fp8 ``quantization_config`` gets real FP8 e4m3 weights
with 128 x 128 block scales. ``--device cpu`` (float32, tiny configs) runs the same code as a smoke test. Every
figure is printed beside its floor, from ceilings measured in the same run (``benchmarks/roofline.py``):

* decode: B sequences holding ``--context`` tokens of KV each (random values), one new token each, through the
  engine's runner (inputs, CUDA graph, sampling, tokens to the host). ``graph ms``: CUDA events around the graph
  replay alone (median); ``step ms``: steps launched back to back, each launched before the previous one's
  tokens are read (what async scheduling sustains), wall time / steps. Floor: (weight bytes the step touches +
  KV bytes read) / measured copy bandwidth. Weights touched: everything but the embedding table (only B rows of
  it are read) and the MTP module; of the routed experts only the distinct experts the batch's router picked,
  counted per MoE layer from the router outputs of one real (eager) step of that batch, printed beside the
  expectation under uniform routing, E (1 - (1 - k/E)^B). KV: B x context x layers x (latent + rope dims, for
  MLA) x bytes; DeepSeek-V4 (``v4_kv_read_bytes``): per layer its window's keys, and per compressed layer the
  entries a query reads (HCA: all context / 128; CSA: the indexer's keys of all context / 4 and the top-512
  entries it picks), from a 4-layer V4-Flash slice (``benchmarks/configs/deepseek-v4-flash-4l``: sliding, CSA,
  CSA, HCA at the real widths).
* prefill: one forward over the prompts (``LEN`` or ``NxLEN``), timed around the step. Floor: FLOPs (2 x matmul
  parameters each token multiplies x tokens, of the routed experts only top_k, + causal attention) / measured
  matmul rate (FP8 weights at the measured FP8 rate); ``of peak`` = floor / measured time.
* idle: the offline engine on ``--idle-batch`` prompts of ``--context`` tokens decoding 128 tokens each; CUDA
  events mark each step's GPU work, and idle = the gaps between consecutive full-batch decode steps over their
  span.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODEL = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="directory holding a config.json")
    p.add_argument("--hf-overrides", type=json.loads, default=None,
                   help='JSON merged into config.json, e.g. \'{"num_hidden_layers": 5}\'')
    p.add_argument("--device", default="cuda", help="cuda | cpu (a smoke test: float32, tiny configs)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill", nargs="*", default=["512", "2048", "8192", "8x2048"])
    p.add_argument("--idle-batch", type=int, default=256, help="0: skip the GPU-idle measurement")
    p.add_argument("--idle-profile", type=int, default=0, metavar="N",
                   help="also print the N functions of most own time in the idle run's host loop (cProfile: a "
                        "call that waits for the GPU shows there)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2 (the floor counts its bytes)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-prefill-graph-tokens", type=int, default=2048,
                   help="prompt steps up to this many tokens run through piecewise CUDA graphs (0: eager)")
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args(argv)


# ---- floors ----------------------------------------------------------------------------------------------------


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


def v4_weight_shape(model: torch.nn.Module) -> WeightShape:
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


def weight_shape(model: torch.nn.Module) -> WeightShape:
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


# ---- ceilings --------------------------------------------------------------------------------------------------


def measure_ceilings(device: torch.device) -> tuple[float, float, float | None]:
    """(copy bandwidth B/s, bf16 matmul FLOP/s, FP8 matmul FLOP/s or None) on CUDA; small CPU stand-ins on CPU."""
    if device.type == "cuda":
        from benchmarks.roofline import measure_bandwidth, measure_bf16_matmul, measure_fp8_matmul

        try:
            fp8 = measure_fp8_matmul()
        except (RuntimeError, AttributeError):  # no FP8 tensor cores
            fp8 = None
        return measure_bandwidth(), measure_bf16_matmul(), fp8
    src = torch.randn(16 << 20)
    dst = torch.empty_like(src)
    copy_s = min(_wall(lambda: dst.copy_(src)) for _ in range(5))
    a = torch.randn(512, 512)
    mm_s = min(_wall(lambda: a @ a) for _ in range(5))
    return 2 * src.numel() * 4 / copy_s, 2 * 512**3 / mm_s, None


def _wall(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def timed_ms(fn, device: torch.device) -> float:
    """Milliseconds of fn(): CUDA events around it on CUDA, wall time on CPU."""
    if device.type != "cuda":
        return _wall(fn) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


# ---- the engine ------------------------------------------------------------------------------------------------


def make_llm(model: Path, args, **kwargs):
    from dsinfer import LLM

    workdir = Path(tempfile.mkdtemp(prefix="dsinfer-latency-"))
    shutil.copy(model / "config.json", workdir / "config.json")
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if device.type == "cuda" else {}
    return LLM(str(workdir), load_format="dummy", dtype=dtype, device=args.device, max_model_len=args.max_model_len,
               hf_overrides=args.hf_overrides, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), **extra,
               **kwargs)


class Sequences:
    """Requests with allocated KV blocks, outside the scheduler, for timing the runner directly."""

    def __init__(self, llm, lengths: list[int], name: str):
        from dsinfer import SamplingParams
        from dsinfer.core.request import Request

        self.kv = llm.engine.kv_manager
        gen = torch.Generator().manual_seed(len(lengths))
        self.requests = []
        for i, n in enumerate(lengths):
            ids = torch.randint(0, llm.engine.model_config.vocab_size, (n,), generator=gen).tolist()
            req = Request(f"{name}{i}", ids, SamplingParams(max_tokens=1, temperature=0.0), seed=0, max_tokens=1)
            if not self.kv.allocate_slots(req, n):
                raise RuntimeError(f"no KV room for {len(lengths)} x {n} tokens")
            self.requests.append(req)

    def randomize_kv(self, runner) -> None:
        used = max(b.block_id for r in self.requests for b in r.blocks) + 1
        for layer in runner.model.attention_layers():
            cache = layer.kv_cache  # [2, blocks, ...] (K and V) or [blocks, block_size, latent + rope] (MLA)
            if cache is None or isinstance(cache, list):  # DeepSeek-V4: paged entries, and rings in state slots
                for part in [c[:used] for c in cache or []] + list((layer.state or {}).values()):
                    part.normal_()
                continue
            part = cache[:, :used] if cache.dim() == 5 else cache[:used]
            if part.element_size() == 1:  # an FP8 cache: no normal_ kernel; draw in bf16, one layer at a time
                part.copy_(torch.randn(part.shape, dtype=torch.bfloat16, device=part.device))
            else:
                part.normal_()

    def free(self) -> None:
        for req in self.requests:
            self.kv.free(req)


def count_touched_experts(runner, sched) -> list[int]:
    """Distinct routed experts each MoE layer's router picks in one eager step of ``sched`` (the MTP module
    excluded; the fused shared experts' columns, after the routed top-k, are not counted; V4's hash-routed layers
    counted like the others)."""
    from dsinfer.layers.moe import Router
    from dsinfer.models.deepseek_v4.moe import V4Router

    def top_k(module) -> int:
        return module.top_k if isinstance(module, V4Router) else module.cfg.top_k

    counts: dict[str, int] = {}
    hooks = [module.register_forward_hook(
        lambda m, _inputs, out, name=name: counts.__setitem__(name, int(out[1][:, :top_k(m)].unique().numel())))
        for name, module in runner.model.named_modules()
        if isinstance(module, (Router, V4Router)) and not name.startswith("mtp.")]
    try:
        with runner.eager():  # hooks do not fire inside a graph replay
            runner.execute(sched)
    finally:
        for hook in hooks:
            hook.remove()
    return list(counts.values())


def time_decode(llm, batch: int, context: int, steps: int, bandwidth: float, shape: WeightShape) -> dict:
    from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

    runner = llm.engine.runner
    device = runner.device
    seqs = Sequences(llm, [context] * batch, f"d{batch}-")
    seqs.randomize_kv(runner)
    items = [ScheduledRequest(r, 1, context - 1) for r in seqs.requests]
    runner.execute(standalone_output(items).plan)  # the runner's table gets the requests
    sched = standalone_output(items, resend=False).plan  # then each step sends what the engine's decode steps do
    for _ in range(2):
        runner.execute(sched)
    graph_ms = []
    size = runner.graphs.padded_size(batch) if runner.graphs is not None else None
    if size is not None:
        graph_ms = [timed_ms(lambda: runner.graphs.replay(size), device) for _ in range(20)]
    step_ms = min(pipelined_ms(runner, sched, steps) for _ in range(3))  # the first also warms pinned buffers
    touched = count_touched_experts(runner, sched) if shape.moe_layers else []
    seqs.free()
    per_seq = kv_read_bytes(runner, context)
    kv_bytes = batch * per_seq
    floor = decode_floor_ms(shape, batch, context, runner.kv_bytes_per_token, bandwidth, touched or None, per_seq)
    row = dict(batch=batch, context=context, step_ms=step_ms,
               graph_ms=statistics.median(graph_ms) if graph_ms else None, floor_ms=floor,
               ratio=step_ms / floor, kv_gb=kv_bytes / 1e9,
               weight_gb=decode_weight_bytes(shape, batch, touched or None) / 1e9)
    if touched:
        expected = expected_distinct_experts(shape.num_experts, shape.top_k, batch)
        row |= dict(experts_touched=statistics.mean(touched), experts_touched_min=min(touched),
                    experts_touched_max=max(touched), experts_expected=expected, num_experts=shape.num_experts,
                    floor_expected_ms=decode_floor_ms(shape, batch, context, runner.kv_bytes_per_token, bandwidth,
                                                      kv_bytes_per_seq=per_seq))
    return row


def kv_read_bytes(runner, context: int) -> int:
    """Cache bytes one sequence's decode step reads at ``context`` tokens."""
    model = runner.model
    if is_v4(model.cfg):
        itemsize = model.attention_layers()[0].state["window"].element_size()
        return v4_kv_read_bytes(model.cfg, context, itemsize)
    return context * runner.kv_bytes_per_token


def pipelined_ms(runner, sched, steps: int) -> float:
    """Wall ms per step with each step launched before the previous step's tokens are read (async scheduling)."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    previous = None
    for _ in range(steps):
        handle = runner.launch(sched)
        if previous is not None:
            previous.result()
        previous = handle
    previous.result()
    return (time.perf_counter() - started) * 1e3 / steps


def parse_prefill(spec: str) -> tuple[int, int]:
    """``LEN`` or ``NxLEN`` -> (N, LEN)."""
    num, _, length = spec.rpartition("x")
    return int(num or 1), int(length)


def time_prefill(llm, spec: str, shape: WeightShape, matmul_rate: float, fp8_rate: float | None) -> dict:
    from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

    num, length = parse_prefill(spec)
    runner = llm.engine.runner
    seqs = Sequences(llm, [length] * num, f"p{spec}-")
    sched = standalone_output([ScheduledRequest(r, length, 0) for r in seqs.requests]).plan
    times = [timed_ms(lambda: runner.execute(sched), runner.device) for _ in range(4)][1:]  # first: warm-up
    seqs.free()
    floor, flops = prefill_floor_ms(shape, runner.model.cfg, num, length, matmul_rate, fp8_rate)
    ms = statistics.median(times)
    return dict(prefill=spec, tokens=num * length, ms=ms, floor_ms=floor, tflops=flops / ms / 1e9,
                of_peak=floor / ms)


def measure_idle(llm, batch: int, context: int, profile: int = 0) -> dict:
    from dsinfer import SamplingParams

    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(1)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (context,), generator=gen).tolist()}
               for _ in range(batch)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    runner.step_events = []
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - started
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    events, runner.step_events = runner.step_events, None
    torch.cuda.synchronize()
    busy = gaps = 0.0
    gap_ms = []
    for (s0, e0, n0), (s1, _e1, n1) in zip(events, events[1:]):
        if n0 == batch and n1 == batch:
            busy += s0.elapsed_time(e0)
            gap_ms.append(e0.elapsed_time(s1))
    gaps = sum(gap_ms)
    span = busy + gaps
    # the decode batches the steps had (a figure of nan: no two consecutive steps ran all ``batch`` requests)
    sizes = collections.Counter(n for *_, n in events)
    return dict(batch=batch, context=context, steps=len(events), wall_s=wall, step_sizes=dict(sizes.most_common(4)),
                idle_pct=100 * gaps / span if span else float("nan"),
                # spread out (host slower than the GPU every step) or a few long stalls (a sync, a GC pass)
                gap_max_ms=max(gap_ms, default=float("nan")), gaps_over_1ms=sum(g > 1 for g in gap_ms),
                gap_median_ms=statistics.median(gap_ms) if gap_ms else float("nan"),
                mean_step_ms=span / max(1, sum(1 for *_, n in events if n == batch) - 1))


def describe(shape: WeightShape, cfg: dict, llm) -> str:
    config = llm.engine.model_config
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    text = (f"model {cfg.get('architectures', ['?'])[0]}, {cfg['num_hidden_layers']} layers, {config.dtype}"
            f"{', weights ' + quant if quant else ''}; decode reads {shape.always_bytes / 1e9:.2f} GB always")
    if shape.moe_layers:
        text += (f" + {shape.expert_bytes[0] / 1e6:.1f} MB per routed expert x {shape.moe_layers} MoE layers "
                 f"(top {shape.top_k} of {shape.num_experts})")
    graphs = llm.engine.runner.prefill_graphs
    text += f"; KV {llm.engine.runner.kv_bytes_per_token} B/token"
    return text + f"; prefill CUDA graphs at {graphs.captured_sizes if graphs else []} tokens"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/latency.py needs a CUDA device (or --device cpu for a smoke test)")
    bandwidth, matmul_rate, fp8_rate = measure_ceilings(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}: copy {bandwidth / 1e12:.2f} TB/s, matmul {matmul_rate / 1e12:.1f} TFLOP/s"
          f"{f', FP8 matmul {fp8_rate / 1e12:.0f} TFLOP/s' if fp8_rate else ''} (measured now)", flush=True)
    max_tokens = max((n * length for n, length in map(parse_prefill, args.prefill)), default=0)
    llm = make_llm(args.model, args, enable_prefix_caching=False, max_num_seqs=max(256, max(args.batch_sizes)),
                   max_num_batched_tokens=max(2048, max_tokens),
                   max_prefill_graph_tokens=args.max_prefill_graph_tokens)
    model = llm.engine.runner.model
    shape = weight_shape(model)
    print(describe(shape, model.cfg, llm), flush=True)
    report: dict = {"device": name, "bandwidth": bandwidth, "matmul_rate": matmul_rate, "fp8_matmul_rate": fp8_rate,
                    "model": str(args.model), "hf_overrides": args.hf_overrides,
                    "architecture": model.cfg.get("architectures", ["?"])[0],
                    "num_hidden_layers": model.cfg["num_hidden_layers"],
                    "quantization": (model.cfg.get("quantization_config") or {}).get("quant_method"),
                    "decode": [], "prefill": []}
    for batch in args.batch_sizes:
        row = time_decode(llm, batch, args.context, args.steps, bandwidth, shape)
        report["decode"].append(row)
        experts = ""
        if "experts_touched" in row:
            experts = (f"; experts touched per MoE layer {row['experts_touched']:.1f} "
                       f"({row['experts_touched_min']}-{row['experts_touched_max']}) of {row['num_experts']}, "
                       f"uniform routing expects {row['experts_expected']:.1f}")
        print(f"decode B={batch:<4} ctx={args.context}: step {row['step_ms']:.3f} ms, graph "
              f"{row['graph_ms'] or float('nan'):.3f} ms, floor {row['floor_ms']:.3f} ms "
              f"({row['weight_gb']:.2f} GB weights + {row['kv_gb']:.2f} GB KV) -> {row['ratio']:.2f}x{experts}",
              flush=True)
    for spec in args.prefill:
        row = time_prefill(llm, spec, shape, matmul_rate, fp8_rate)
        report["prefill"].append(row)
        print(f"prefill {spec:>7}: {row['ms']:.1f} ms, floor {row['floor_ms']:.1f} ms, {row['tflops']:.0f} "
              f"TFLOP/s = {100 * row['of_peak']:.0f}% of the measured matmul rate(s)", flush=True)
    if args.idle_batch and device.type == "cuda":
        report["idle"] = measure_idle(llm, args.idle_batch, args.context, args.idle_profile)
        idle = report["idle"]
        print(f"engine decode B={idle['batch']}: GPU idle between steps {idle['idle_pct']:.2f}% "
              f"(mean step {idle['mean_step_ms']:.2f} ms over {idle['steps']} steps; "
              f"most common decode batches {idle['step_sizes']}, -1: a step with prompt tokens; gaps: median "
              f"{idle['gap_median_ms']:.3f} ms, max {idle['gap_max_ms']:.2f} ms, {idle['gaps_over_1ms']} over 1 ms)",
              flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
