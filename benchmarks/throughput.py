"""Offline throughput: dsinfer on N random-token prompts, optionally against HF transformers ``generate``.

    python benchmarks/throughput.py --num-prompts 32 --input-len 128 --output-len-range 16 256 --compare-hf

Prompts are random token ids (seeded) of ``--input-len`` tokens; each asks for ``--output-len`` tokens, or
a length drawn uniformly from ``--output-len-range MIN MAX``. Decoding is greedy, with EOS ignored by default,
so every request produces exactly the tokens it asked for. HF runs each batch padded to its longest request
(``min_new_tokens = max_new_tokens``), so its *useful* tokens/s counts only the tokens each prompt asked for;
the ratio compares dsinfer's output tokens/s with that. With ``--repeat R`` the engines run alternately R
times each and the fastest run of each is reported (the machine may be shared); ``cpu s`` is the process CPU
time of the run, less sensitive than wall time to other processes when ``--threads 1``.

On CUDA with dummy weights at real shapes (a directory holding only a config.json):

    python benchmarks/throughput.py --device cuda --dtype bfloat16 --load-format dummy \
        --model benchmarks/configs/llama-3.1-8b --num-prompts 512 --input-len 1000 --output-len 1000 \
        --compare-hf --hf-num-prompts 32 --hf-output-len 100

``--compare-hf`` then builds the HF model from the config with dsinfer's random weights copied in, and runs both
engines on a subset (``--hf-num-prompts`` x ``--hf-output-len``, since HF on the full workload takes too long);
the HF model is freed before dsinfer's full run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Result:
    engine: str
    elapsed_s: float
    cpu_s: float  # process CPU time of the run (all threads)
    num_prompts: int
    prompt_tokens: int
    output_tokens: int  # tokens the prompts asked for (HF's padded extra tokens not included)
    generated_tokens: int  # tokens actually computed (HF: batch x longest request)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="mixed output lengths drawn uniformly from [MIN, MAX] (seeded)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and output lengths")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both engines")
    p.add_argument("--compare-hf", action="store_true", help="also run HF generate on it")
    p.add_argument("--batch-hf", type=int, default=None, help="HF batch size (default: all prompts at once)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine, alternating; best kept")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights at the config's shapes)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--deterministic", action="store_true", help="batch-invariant mode (LLM(deterministic=True))")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2 (LLM(kv_cache_dtype=...))")
    p.add_argument("--hf-overrides", type=json.loads, default=None,
                   help='JSON merged into config.json, e.g. \'{"num_hidden_layers": 8}\'')
    p.add_argument("--hf-num-prompts", type=int, default=None, help="HF runs only this many prompts (subset)")
    p.add_argument("--hf-output-len", type=int, default=None, help="output length of the HF subset")
    p.add_argument("--step-breakdown", action="store_true",
                   help="CUDA: GPU time of the last dsinfer run's steps, prompt steps apart from decode steps by batch")
    args = p.parse_args(argv)
    if args.output_len_range and not 1 <= args.output_len_range[0] <= args.output_len_range[1]:
        p.error(f"--output-len-range needs 1 <= MIN <= MAX, got {args.output_len_range}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def make_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    if args.output_len_range:
        low, high = args.output_len_range
        lengths = [rng.randint(low, high) for _ in range(args.num_prompts)]
    else:
        lengths = [args.output_len] * args.num_prompts
    return prompts, lengths


def run_dsinfer(llm, prompts: list[list[int]], lengths: list[int], ignore_eos: bool) -> tuple[Result, list]:
    from dsinfer import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)

    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], [params(4)] * min(2, len(inputs)), use_tqdm=False)  # warm-up
    if llm.engine.runner.step_events is not None:  # --step-breakdown: the timed steps only
        llm.engine.runner.step_events.clear()
    llm.engine.kv_manager.pool.reset_prefix_cache()  # a repeat must not hit the previous run's prefixes
    started, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(inputs, [params(n) for n in lengths], use_tqdm=False)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = [o.outputs[0].token_ids for o in outputs]
    produced = sum(len(t) for t in tokens)
    return Result("dsinfer", elapsed, cpu, len(prompts), sum(map(len, prompts)), produced, produced), tokens


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


def load_hf(model_dir: Path, dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run_hf(model, device: str, prompts: list[list[int]], lengths: list[int], batch_size: int,
           ignore_eos: bool) -> tuple[Result, list]:
    import torch

    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)

    def generate(batch: list[list[int]], new_tokens: int):
        ids = torch.tensor(batch, device=device)
        extra = {"min_new_tokens": new_tokens} if ignore_eos else {}
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=pad, **extra)

    generate(prompts[:2], 4)  # warm-up
    tokens, generated = [], 0
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(prompts), batch_size):
        batch, wanted = prompts[start:start + batch_size], lengths[start:start + batch_size]
        out = generate(batch, max(wanted))
        generated += out.shape[0] * (out.shape[1] - len(batch[0]))
        tokens += [row[len(batch[0]):len(batch[0]) + n].tolist() for row, n in zip(out, wanted)]
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    useful = sum(len(t) for t in tokens)
    return Result("hf-transformers", elapsed, cpu, len(prompts), sum(map(len, prompts)), useful, generated), tokens


def hf_from_engine(llm, device: str, overrides: dict | None = None):
    """The HF model of llm's config with llm's weights copied in (merged q/k/v and gate/up split back; DeepSeek's
    stacked experts copied whole or per expert, as the installed transformers lays them out)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = llm.engine.runner.model
    config = AutoConfig.from_pretrained(llm.engine.model_config.path, **(overrides or {}))
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=llm.engine.model_config.dtype).eval()
    with torch.no_grad():
        if hasattr(type(ours), "packed_modules"):
            _copy_llama_into_hf(ours, hf.state_dict())
        else:
            _copy_by_checkpoint_names(ours, hf.state_dict())
    return hf


def _copy_llama_into_hf(ours, state: dict) -> None:
    unpacked = {merged: name for name, merged in type(ours).packed_modules.items()}
    for name, param in ours.named_parameters():
        module_name, leaf = name.rsplit(".", 1)
        shards = getattr(ours.get_submodule(module_name), "shard_offsets", {})
        if len(shards) > 1:
            parent, merged = module_name.rsplit(".", 1)
            for shard_id, (offset, size) in shards.items():
                state[f"model.{parent}.{unpacked[(merged, shard_id)]}.{leaf}"].copy_(param[offset:offset + size])
        elif name.startswith("lm_head."):
            if not ours.lm_head.tied:
                state[name].copy_(param)
        else:
            state[f"model.{name}"].copy_(param)


def _copy_by_checkpoint_names(ours, state: dict) -> None:
    """Fill every HF tensor from ours through the model's own checkpoint-name routing (``checkpoint_name``:
    checkpoint name -> (our parameter, shard)), read in reverse: the shard of a merged parameter, what a checkpoint
    tensor fills of the stacked experts (``FusedExperts.checkpoint_tensor``), or the whole parameter."""
    from dsinfer.layers.moe import FusedExperts
    from dsinfer.ops.fp8 import FP8_DTYPE

    params = dict(ours.named_parameters())
    missing = []
    for key, target in state.items():
        routed = ours.checkpoint_name(key)
        if routed is None:
            continue
        name, shard = routed
        source = params.get(name)
        if source is None:
            missing.append(key)
            continue
        if source.dtype == FP8_DTYPE:
            raise ValueError("the HF comparison needs a bf16/fp32 model; this one has FP8 weights")
        module_name, leaf = name.rsplit(".", 1)
        module = ours.get_submodule(module_name)
        if isinstance(module, FusedExperts):  # one expert, the routed stack, or the fused shared experts' MLP
            source = module.checkpoint_tensor(leaf, shard)
        elif shard is not None:
            offset, size = module.shard_offsets[shard]
            source = source[offset:offset + size]
        if source.shape != target.shape:
            raise ValueError(f"HF tensor {key} {tuple(target.shape)} != ours {name} {tuple(source.shape)}")
        target.copy_(source.to(target.dtype) if target.is_floating_point() else source)
    if missing:
        raise ValueError(f"{len(missing)} HF tensor(s) have no counterpart in dsinfer's model, e.g. {missing[:5]}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare_with_hf_subset(llm, args, prompts, lengths) -> dict:
    """dsinfer and HF on the same subset of the workload; HF's model is freed afterwards."""
    import gc

    import torch

    count = args.hf_num_prompts or len(prompts)
    sub_prompts = prompts[:count]
    sub_lengths = [args.hf_output_len or n for n in lengths[:count]]
    if args.load_format == "dummy":
        hf_model = hf_from_engine(llm, args.device, args.hf_overrides)
    else:
        hf_model = load_hf(llm.engine.model_config.path, llm.engine.model_config.dtype, args.device)
    hf, hf_tokens = run_hf(hf_model, args.device, sub_prompts, sub_lengths, args.batch_hf or count, args.ignore_eos)
    del hf_model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    ours, our_tokens = run_dsinfer(llm, sub_prompts, sub_lengths, args.ignore_eos)
    same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
    prefix = sum(common_prefix(a, b) for a, b in zip(our_tokens, hf_tokens)) / count
    print(f"HF subset ({count} prompts x {args.input_len} in / {sub_lengths[0]} out): identical greedy outputs "
          f"{same}/{count}, mean common prefix {prefix:.1f} tokens")
    print_table([ours, hf])
    return {"subset": {"num_prompts": count, "output_len": sub_lengths[0], "dsinfer": asdict(ours),
                       "hf": asdict(hf), "dsinfer_output_tok_s": ours.output_tok_s,
                       "hf_output_tok_s": hf.output_tok_s, "ratio": ours.output_tok_s / hf.output_tok_s,
                       "identical_outputs": same, "mean_common_prefix": prefix}}


def print_table(results: list[Result]) -> None:
    print(f"{'engine':<16} {'elapsed s':>10} {'cpu s':>8} {'output tok/s':>13} {'total tok/s':>12} "
          f"{'computed tok':>13}")
    for r in results:
        print(f"{r.engine:<16} {r.elapsed_s:>10.2f} {r.cpu_s:>8.2f} {r.output_tok_s:>13.1f} {r.total_tok_s:>12.1f} "
              f"{r.generated_tokens:>13}")
    if len(results) == 2:
        ratio = results[0].output_tok_s / results[1].output_tok_s
        cpu_ratio = results[1].cpu_s / results[0].cpu_s
        print(f"ratio dsinfer / HF (useful output tok/s): {ratio:.2f}x wall, {cpu_ratio:.2f}x by CPU time")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from dsinfer import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {}
    if args.device == "cuda":
        extra = dict(max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                     max_model_len=args.input_len + max(args.output_len, *(args.output_len_range or [0])) + 16)
        if args.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed, load_format=args.load_format,
              deterministic=args.deterministic, hf_overrides=args.hf_overrides, kv_cache_dtype=args.kv_cache_dtype,
              **extra)
    config = llm.engine.model_config
    prompts, lengths = make_workload(args, config.vocab_size)
    print(f"model {config.served_model_name} ({config.path}), dtype {config.dtype}, device {args.device}, "
          f"threads {torch.get_num_threads()}; {len(prompts)} prompts x {args.input_len} tokens, "
          f"outputs {min(lengths)}-{max(lengths)} (sum {sum(lengths)}), ignore_eos={args.ignore_eos}")
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    subset = args.compare_hf and (args.hf_num_prompts or args.hf_output_len or args.load_format == "dummy")
    if subset:
        report |= compare_with_hf_subset(llm, args, prompts, lengths)
    hf_model = load_hf(config.path, config.dtype, args.device) if args.compare_hf and not subset else None
    ours = hf = None
    breakdown = args.step_breakdown and args.device == "cuda"
    for _ in range(args.repeat):
        if breakdown:
            llm.engine.runner.step_events = []  # filled by the runner: (start, done, decode batch or -1)
        run, our_tokens = run_dsinfer(llm, prompts, lengths, args.ignore_eos)
        ours = run if ours is None or run.elapsed_s < ours.elapsed_s else ours
        print(f"  dsinfer run: {run.elapsed_s:.2f} s")
        if hf_model is not None:
            run, hf_tokens = run_hf(hf_model, args.device, prompts, lengths, args.batch_hf or len(prompts),
                                    args.ignore_eos)
            hf = run if hf is None or run.elapsed_s < hf.elapsed_s else hf
            print(f"  HF run: {run.elapsed_s:.2f} s")
    results = [ours]
    if hf is not None:
        results.append(hf)
        same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
        print(f"greedy outputs identical to HF: {same}/{len(prompts)}")
        report["ratio_output_tok_s"] = ours.output_tok_s / hf.output_tok_s
        report["ratio_cpu_time"] = hf.cpu_s / ours.cpu_s
        report["identical_outputs"] = same
    print_table(results)
    if breakdown:
        torch.cuda.synchronize()
        print("where the last dsinfer run's GPU time went:")
        for kind, n, sec in step_breakdown(llm.engine.runner):
            print(f"  {kind:28s} {n:6d} steps {sec:8.2f} s ({1e3 * sec / max(n, 1):.3f} ms/step)")
        llm.engine.runner.step_events = None
    if subset:
        ratio = ours.output_tok_s / report["subset"]["hf_output_tok_s"]
        report["ratio_full_vs_hf_subset"] = ratio
        print(f"dsinfer full workload vs HF subset (useful output tok/s): {ratio:.1f}x")
    report["results"] = [asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s}
                         for r in results]
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
