"""``dsinfer bench latency --batch-sizes ... --prefill ...``: the runner's steps timed directly, each beside its
roofline floor (``roofline.py``) from ceilings measured in the same run (``ceilings.py``).

* decode: B sequences holding ``--context`` tokens of KV each (random values), one new token each, through the
  engine's runner (inputs, CUDA graph, sampling, tokens to the host). ``graph ms``: CUDA events around the graph
  replay alone (median); ``step ms``: steps launched back to back, each launched before the previous one's
  tokens are read (what async scheduling sustains), wall time / steps; against the floor of the weights touched
  (the distinct experts the batch's router picked in one real eager step, beside the uniform-routing
  expectation) and the KV read;
* prefill: one forward over the prompts (``LEN`` or ``NxLEN``), timed around the step, against its FLOPs at the
  measured matmul rate (``of peak`` = floor / measured time);
* idle (CUDA): the offline engine on ``--idle-batch`` prompts of ``--context`` tokens decoding 128 tokens each;
  CUDA events mark each step's GPU work, and idle = the gaps between consecutive full-batch decode steps over
  their span (``--idle-profile N``: the N functions of most own time in that run's host loop, by cProfile).
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import statistics
import time

import torch

from dsinfer.bench.roofline import (
    WeightShape,
    decode_floor_ms,
    decode_weight_bytes,
    expected_distinct_experts,
    kv_read_bytes,
    prefill_floor_ms,
)


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


class Sequences:
    """Requests with allocated KV blocks, outside the scheduler, for timing the runner directly."""

    def __init__(self, llm, lengths: list[int], name: str):
        from dsinfer.core.request import Request
        from dsinfer.engine.sampling_params import SamplingParams

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
    per_seq = kv_read_bytes(runner.model, runner.kv_bytes_per_token, context)
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
    from dsinfer.engine.sampling_params import SamplingParams

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


def _decode_line(row: dict) -> str:
    experts = ""
    if "experts_touched" in row:
        experts = (f"; experts touched per MoE layer {row['experts_touched']:.1f} "
                   f"({row['experts_touched_min']}-{row['experts_touched_max']}) of {row['num_experts']}, "
                   f"uniform routing expects {row['experts_expected']:.1f}")
    return (f"decode B={row['batch']:<4} ctx={row['context']}: step {row['step_ms']:.3f} ms, graph "
            f"{row['graph_ms'] or float('nan'):.3f} ms, floor {row['floor_ms']:.3f} ms "
            f"({row['weight_gb']:.2f} GB weights + {row['kv_gb']:.2f} GB KV) -> {row['ratio']:.2f}x{experts}")


def _idle_line(idle: dict) -> str:
    return (f"engine decode B={idle['batch']}: GPU idle between steps {idle['idle_pct']:.2f}% "
            f"(mean step {idle['mean_step_ms']:.2f} ms over {idle['steps']} steps; "
            f"most common decode batches {idle['step_sizes']}, -1: a step with prompt tokens; gaps: median "
            f"{idle['gap_median_ms']:.3f} ms, max {idle['gap_max_ms']:.2f} ms, {idle['gaps_over_1ms']} over 1 ms)")


def run_step_tables(llm, ceilings, batch_sizes: list[int], context: int, steps: int, prefill: list[str],
                    idle_batch: int, idle_profile: int = 0) -> dict:
    """Every table, printed row by row as measured; -> the report (``--output-json``)."""
    from dsinfer.bench.roofline import describe_model, weight_shape

    runner = llm.engine.runner
    model = runner.model
    shape = weight_shape(model)
    graphs = runner.prefill_graphs
    print(describe_model(shape, model.cfg, llm.engine.model_config.dtype, runner.kv_bytes_per_token)
          + f"; prefill CUDA graphs at {graphs.captured_sizes if graphs else []} tokens", flush=True)
    report: dict = {"device": ceilings.device, "bandwidth": ceilings.bandwidth, "matmul_rate": ceilings.matmul_rate,
                    "fp8_matmul_rate": ceilings.fp8_matmul_rate, "model": str(llm.engine.model_config.path),
                    "architecture": model.cfg.get("architectures", ["?"])[0],
                    "num_hidden_layers": model.cfg["num_hidden_layers"],
                    "quantization": (model.cfg.get("quantization_config") or {}).get("quant_method"),
                    "decode": [], "prefill": []}
    for batch in batch_sizes:
        row = time_decode(llm, batch, context, steps, ceilings.bandwidth, shape)
        report["decode"].append(row)
        print(_decode_line(row), flush=True)
    for spec in prefill:
        row = time_prefill(llm, spec, shape, ceilings.matmul_rate, ceilings.fp8_matmul_rate)
        report["prefill"].append(row)
        print(f"prefill {spec:>7}: {row['ms']:.1f} ms, floor {row['floor_ms']:.1f} ms, {row['tflops']:.0f} "
              f"TFLOP/s = {100 * row['of_peak']:.0f}% of the measured matmul rate(s)", flush=True)
    if idle_batch and runner.device.type == "cuda":
        report["idle"] = measure_idle(llm, idle_batch, context, idle_profile)
        print(_idle_line(report["idle"]), flush=True)
    return report


# ---- the engine's own steps (``dsinfer bench throughput --step-breakdown``) ----


def summarize_steps(steps: list[tuple[float, float, int]]) -> list[tuple[str, int, float]]:
    """``steps``: per engine step in order, (GPU ms, GPU idle ms before it, its decode batch or -1 when it has
    prompt tokens) -> rows (kind, steps, seconds): steps with prompt tokens, decode steps at the largest batch
    seen, smaller decode steps, and the idle time between steps (host work the GPU waited for)."""
    full = max((n for _, _, n in steps), default=0)
    rows: dict[str, list[float]] = {}
    for ms, _, n in steps:
        kind = "steps with prompt tokens" if n < 0 else f"decode steps, B={full}" if n == full else \
            f"decode steps, B<{full}"
        entry = rows.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += ms / 1e3
    out = [(kind, int(n), sec) for kind, (n, sec) in rows.items()]
    return out + [("GPU idle between steps", len(steps), sum(idle for _, idle, _ in steps) / 1e3)]


def step_breakdown(runner) -> list[tuple[str, int, float]]:
    """``summarize_steps`` of the CUDA events the runner recorded (``runner.step_events``)."""
    events = runner.step_events or []
    steps = [(start.elapsed_time(done), events[i - 1][1].elapsed_time(start) if i else 0.0, n)
             for i, (start, done, n) in enumerate(events)]
    return summarize_steps(steps)
