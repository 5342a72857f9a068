"""Where a decode (or prefill) step's GPU time goes: the CUDA kernels of eager engine steps, grouped by name.

    python benchmarks/profile_decode.py [--model benchmarks/configs/llama-3.1-8b] [--batch 1] [--context 1024]
    python benchmarks/profile_decode.py --prefill --batch 8 --context 1024   # one step prefilling 8 x 1024 tokens
    python benchmarks/profile_decode.py --replay --batch 256   # the decode graph replay alone (no scheduler)

Runs ``--batch`` prompts of ``--context`` random tokens through the offline engine with ``enforce_eager`` (or
through the decode CUDA graphs with ``--graph``: the same kernels, unless a library picks others under capture),
profiles ``--steps`` decode steps after a warm-up, and prints each kernel's time and launches per step, the sum,
and the share of the step the GPU was busy.
A kernel that reads the weights is compared with the bandwidth floor of its bytes by ``dsinfer bench latency``
(the runner's step tables); this script
only answers "which kernels, how many, how long".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODEL = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"


def make_llm(model: Path, args, **kwargs):
    """The engine on dummy weights at ``model``'s config (bf16 on CUDA, float32 on CPU)."""
    from dsinfer import LLM

    cuda = torch.device(args.device).type == "cuda"
    extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if cuda else {}
    return LLM(str(model), load_format="dummy", dtype=args.dtype or ("bfloat16" if cuda else "float32"),
               device=args.device, max_model_len=args.max_model_len, hf_overrides=args.hf_overrides,
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), **extra, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--hf-overrides", type=json.loads, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--prefill", action="store_true", help="profile steps that prefill --batch x --context tokens")
    p.add_argument("--graph", action="store_true",
                   help="decode through the CUDA graphs (CUPTI still reports the kernels a replay runs)")
    p.add_argument("--replay", action="store_true",
                   help="profile the runner's decode step alone (graph replay at the padded batch, or one eager "
                        "step), over --batch sequences of --context cached tokens: no scheduler, no prefill")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile the host side (cProfile) of the same steps and print its top N functions")
    p.add_argument("--sequence", type=int, default=0, metavar="N",
                   help="also print the last step's first N kernels in launch order, with their gaps")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from dsinfer import SamplingParams

    extra = {}
    if args.prefill:  # every prompt in one step, none of it from the prefix cache
        extra = dict(enable_prefix_caching=False, max_num_batched_tokens=args.batch * args.context,
                     max_num_seqs=max(args.batch, 1))
    llm = make_llm(args.model, args, enforce_eager=not (args.graph or args.replay), **extra)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    if args.replay:
        return report(profile_replay(llm, args, sync), args)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size

    def random_prompts():
        return [{"prompt_token_ids": torch.randint(10, min(vocab, 32000), (args.context,), generator=gen).tolist()}
                for _ in range(args.batch)]

    prompts = random_prompts()
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    engine = llm.engine
    if args.prefill:
        return report(profile_prefill(llm, random_prompts, args, sync), args)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    base = engine.get_stats()["num_generation_tokens"]
    while engine.get_stats()["num_generation_tokens"] < base + 2 * args.batch:
        engine.step()  # prefill, then decode until every sequence is past its first token
    sync()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    while engine.has_unfinished_requests():
        engine.step()
    return report((prof, wall_ms, args.steps, "graph decode steps" if args.graph else "eager decode steps"), args)


def profile_replay(llm, args, sync):
    """The kernels of one decode step of the runner over ``--batch`` sequences of ``--context`` cached tokens."""
    from torch.profiler import ProfilerActivity, profile

    from dsinfer.bench.steps import Sequences
    from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

    runner = llm.engine.runner
    seqs = Sequences(llm, [args.context] * args.batch, "r")
    seqs.randomize_kv(runner)
    items = [ScheduledRequest(r, 1, args.context - 1) for r in seqs.requests]
    runner.execute(standalone_output(items).plan)
    sched = standalone_output(items, resend=False).plan
    size = runner.graphs.padded_size(args.batch) if runner.graphs is not None else None
    step = (lambda: runner.graphs.replay(size)) if size is not None else (lambda: runner.execute(sched))
    for _ in range(3):
        runner.execute(sched)
        step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    seqs.free()
    return prof, wall_ms, args.steps, "graph replays" if size is not None else "eager runner steps"


def profile_prefill(llm, random_prompts, args, sync):
    """Each profiled step prefills a fresh set of prompts (max_tokens=1: the step that samples the first token)."""
    from torch.profiler import ProfilerActivity, profile

    from dsinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    batches = [random_prompts() for _ in range(args.steps)]
    sync()
    before = allocator_counts()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, host_profile(args):
        start = time.perf_counter()
        for prompts in batches:
            llm.generate(prompts, params, use_tqdm=False)
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    after = allocator_counts()
    print("allocator events per step (a device malloc/free or retry synchronizes the GPU): "
          + ", ".join(f"{k} {(after[k] - before[k]) / args.steps:g}" for k in before))
    return prof, wall_ms, args.steps, "prefill steps"


def allocator_counts() -> dict[str, int]:
    """The caching allocator's counters that mean a cudaMalloc / cudaFree (or a full synchronize) happened."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: stats.get(k, 0) for k in keys}


def host_profile(args):
    """A context manager: cProfile over the profiled steps when ``--cprofile N``, printing the top N functions by
    own time (where the host spends a step that the GPU waits for)."""
    import contextlib
    import cProfile
    import pstats

    @contextlib.contextmanager
    def run():
        if not args.cprofile:
            yield
            return
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    return run()


def report(profiled, args) -> int:
    prof, wall_ms, steps, what = profiled
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[event.name]
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
    if not per_kernel:
        print(f"{wall_ms:.3f} ms wall/step; no CUDA kernels recorded (device {args.device})")
        return 0
    total_ms = sum(t for t, _ in per_kernel.values()) / steps
    launches = sum(n for _, n in per_kernel.values()) / steps
    print(f"batch {args.batch}, context {args.context}: {steps} {what}, {wall_ms:.3f} ms wall/step, "
          f"GPU busy {total_ms:.3f} ms/step ({100 * total_ms / wall_ms:.0f}%), {launches:.0f} kernels/step")
    print(f"{'ms/step':>8} {'share':>6} {'n/step':>7}  kernel")
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{ms / steps:8.3f} {100 * ms / steps / total_ms:5.1f}% {n / steps:7.1f}  {name[:110]}")
    if args.sequence:
        print_sequence(prof, launches, args.sequence)
    return 0


def print_sequence(prof, launches: float, count: int) -> None:
    """The last profiled step's first ``count`` kernels in start order: start and duration in µs and the gap since
    the previous kernel ended (negative: they overlapped, e.g. under programmatic dependent launch)."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    last = kernels[-round(launches):][:count]
    if not last:
        return
    print(f"{'start us':>9} {'us':>7} {'gap us':>7}  kernel (the last step, launch order)")
    t0, prev_end = last[0].time_range.start, last[0].time_range.start
    for e in last:
        start, end = e.time_range.start, e.time_range.end
        print(f"{start - t0:9.1f} {end - start:7.2f} {start - prev_end:7.2f}  {e.name[:90]}")
        prev_end = max(prev_end, end)


if __name__ == "__main__":
    sys.exit(main())
