"""Decode step time vs batch size at a fixed context, prefill time vs length, and GPU idle between engine steps.

    python benchmarks/latency.py [--model benchmarks/configs/llama-3.1-8b] [--batch-sizes 1 64 256]
                                 [--context 1024] [--prefill 512 2048 8x2048] [--idle-batch 256] [--json-out F]

CUDA, dummy weights at the config's real shapes, bf16. Every figure is printed beside its floor, from ceilings
measured in the same run (``benchmarks/roofline.py``):

* decode: B sequences holding ``--context`` tokens of KV each (random values), one new token each, through the
  engine's runner (inputs, CUDA graph, sampling, tokens to the host). ``graph ms``: CUDA events around the graph
  replay alone (median); ``step ms``: steps launched back to back, each launched before the previous one's
  tokens are read (what async scheduling sustains), wall time / steps. Floor: (weight bytes read + KV bytes
  read) / measured copy bandwidth (the embedding table is not read, only B rows of it).
* prefill: one forward over the prompts (``LEN`` or ``NxLEN``), events around the step. Floor: FLOPs (2 x matmul
  parameters x tokens + causal attention) / measured bf16 matmul rate; ``of peak`` = achieved / measured rate.
* idle: the offline engine on ``--idle-batch`` prompts of ``--context`` tokens decoding 128 tokens each; CUDA
  events mark each step's GPU work, and idle = the gaps between consecutive full-batch decode steps over their
  span.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import measure_bandwidth, measure_bf16_matmul  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="directory holding a config.json")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill", nargs="+", default=["512", "2048", "8192", "8x2048"])
    p.add_argument("--idle-batch", type=int, default=256, help="0: skip the GPU-idle measurement")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args(argv)


def make_llm(model: Path, args, **kwargs):
    from dsinfer import LLM

    workdir = Path(tempfile.mkdtemp(prefix="dsinfer-latency-"))
    shutil.copy(model / "config.json", workdir / "config.json")
    return LLM(str(workdir), load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=8192,
               gpu_memory_utilization=args.gpu_memory_utilization, **kwargs)


def weight_bytes_read(model) -> int:
    """Bytes a decode step reads of the weights: all parameters but the embedding table (B rows of it)."""
    embed = model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or model.lm_head.tied)


def matmul_params(model) -> int:
    """Parameters multiplied by every token (the decoder layers' linear weights)."""
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and n.endswith("proj.weight"))


class Sequences:
    """Requests with allocated KV blocks, outside the scheduler, for timing the runner directly."""

    def __init__(self, llm, lengths: list[int], name: str):
        from dsinfer import SamplingParams
        from dsinfer.engine.request import Request

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
            layer.kv_cache[:, :used].normal_()

    def free(self) -> None:
        for req in self.requests:
            self.kv.free(req)


def time_decode(llm, batch: int, context: int, steps: int, bandwidth: float) -> dict:
    from dsinfer.scheduler.scheduler import ScheduledRequest, SchedulerOutput

    runner = llm.engine.runner
    seqs = Sequences(llm, [context] * batch, f"d{batch}-")
    seqs.randomize_kv(runner)
    sched = SchedulerOutput([ScheduledRequest(r, 1, context - 1) for r in seqs.requests])
    for _ in range(3):
        runner.execute(sched)
    graph_ms = []
    size = runner.graphs.padded_size(batch) if runner.graphs is not None else None
    if size is not None:
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.graphs.replay(size)
            end.record()
            end.synchronize()
            graph_ms.append(start.elapsed_time(end))
    step_ms = min(pipelined_ms(runner, sched, steps) for _ in range(3))  # the first also warms pinned buffers
    seqs.free()
    kv_bytes = batch * context * runner.kv_bytes_per_token
    floor = (weight_bytes_read(runner.model) + kv_bytes) / bandwidth * 1e3
    return dict(batch=batch, context=context, step_ms=step_ms,
                graph_ms=statistics.median(graph_ms) if graph_ms else None, floor_ms=floor,
                ratio=step_ms / floor, kv_gb=kv_bytes / 1e9)


def pipelined_ms(runner, sched, steps: int) -> float:
    """Wall ms per step with each step launched before the previous step's tokens are read (async scheduling)."""
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


def time_prefill(llm, spec: str, matmul_rate: float) -> dict:
    from dsinfer.scheduler.scheduler import ScheduledRequest, SchedulerOutput

    num, _, length = spec.rpartition("x")
    num, length = int(num or 1), int(length)
    runner = llm.engine.runner
    model = runner.model
    seqs = Sequences(llm, [length] * num, f"p{spec}-")
    sched = SchedulerOutput([ScheduledRequest(r, length, 0) for r in seqs.requests])
    times = []
    for i in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.execute(sched)
        end.record()
        end.synchronize()
        if i:  # the first run compiles / warms up
            times.append(start.elapsed_time(end))
    seqs.free()
    cfg = model.cfg
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = 4 * head_dim * cfg["num_attention_heads"] * cfg["num_hidden_layers"] * num * length * (length + 1) / 2
    flops = 2 * matmul_params(model) * num * length + attn + 2 * model.lm_head.weight.numel() * num
    ms = statistics.median(times)
    return dict(prefill=spec, tokens=num * length, ms=ms, floor_ms=flops / matmul_rate * 1e3,
                tflops=flops / ms / 1e9, of_peak=flops / (ms * 1e-3) / matmul_rate)


def measure_idle(llm, batch: int, context: int) -> dict:
    from dsinfer import SamplingParams

    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(1)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (context,), generator=gen).tolist()}
               for _ in range(batch)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    runner.step_events = []
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    events, runner.step_events = runner.step_events, None
    torch.cuda.synchronize()
    busy = gaps = 0.0
    for (s0, e0, n0), (s1, _e1, n1) in zip(events, events[1:]):
        if n0 == batch and n1 == batch:
            busy += s0.elapsed_time(e0)
            gaps += e0.elapsed_time(s1)
    span = busy + gaps
    return dict(batch=batch, context=context, steps=len(events), wall_s=wall,
                idle_pct=100 * gaps / span if span else float("nan"),
                mean_step_ms=span / max(1, sum(1 for *_, n in events if n == batch) - 1))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/latency.py needs a CUDA device")
    bandwidth, matmul_rate = measure_bandwidth(), measure_bf16_matmul()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul "
          f"{matmul_rate / 1e12:.0f} TFLOP/s (measured now)", flush=True)
    max_tokens = max(int(s.rpartition("x")[0] or 1) * int(s.rpartition("x")[2]) for s in args.prefill)
    llm = make_llm(args.model, args, enable_prefix_caching=False, max_num_seqs=max(256, max(args.batch_sizes)),
                   max_num_batched_tokens=max(2048, max_tokens))
    report: dict = {"bandwidth": bandwidth, "matmul_rate": matmul_rate, "decode": [], "prefill": []}
    for batch in args.batch_sizes:
        row = time_decode(llm, batch, args.context, args.steps, bandwidth)
        report["decode"].append(row)
        print(f"decode B={batch:<4} ctx={args.context}: step {row['step_ms']:.3f} ms, graph "
              f"{row['graph_ms'] or float('nan'):.3f} ms, floor {row['floor_ms']:.3f} ms "
              f"-> {row['ratio']:.2f}x", flush=True)
    for spec in args.prefill:
        row = time_prefill(llm, spec, matmul_rate)
        report["prefill"].append(row)
        print(f"prefill {spec:>7}: {row['ms']:.1f} ms, floor {row['floor_ms']:.1f} ms, {row['tflops']:.0f} "
              f"TFLOP/s = {100 * row['of_peak']:.0f}% of measured bf16 matmul", flush=True)
    if args.idle_batch:
        report["idle"] = measure_idle(llm, args.idle_batch, args.context)
        idle = report["idle"]
        print(f"engine decode B={idle['batch']}: GPU idle between steps {idle['idle_pct']:.2f}% "
              f"(mean step {idle['mean_step_ms']:.2f} ms over {idle['steps']} steps)", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
