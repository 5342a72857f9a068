"""Offline throughput: dsinfer on N random-token prompts, optionally against HF transformers ``generate``.

    python benchmarks/throughput.py --num-prompts 32 --input-len 128 --output-len-range 16 256 --compare-hf

Prompts are random token ids (seeded) of ``--input-len`` tokens; each asks for ``--output-len`` tokens, or
a length drawn uniformly from ``--output-len-range MIN MAX``. Decoding is greedy, with EOS ignored by default,
so every request produces exactly the tokens it asked for. HF runs each batch padded to its longest request
(``min_new_tokens = max_new_tokens``), so its *useful* tokens/s counts only the tokens each prompt asked for;
the ratio compares dsinfer's output tokens/s with that. With ``--repeat R`` the engines run alternately R
times each and the fastest run of each is reported (the machine may be shared).
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
    llm.engine.kv_manager.pool.reset_prefix_cache()  # a repeat must not hit the previous run's prefixes
    started = time.perf_counter()
    outputs = llm.generate(inputs, [params(n) for n in lengths], use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = [o.outputs[0].token_ids for o in outputs]
    produced = sum(len(t) for t in tokens)
    return Result("dsinfer", elapsed, len(prompts), sum(map(len, prompts)), produced, produced), tokens


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
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch, wanted = prompts[start:start + batch_size], lengths[start:start + batch_size]
        out = generate(batch, max(wanted))
        generated += out.shape[0] * (out.shape[1] - len(batch[0]))
        tokens += [row[len(batch[0]):len(batch[0]) + n].tolist() for row, n in zip(out, wanted)]
    elapsed = time.perf_counter() - started
    useful = sum(len(t) for t in tokens)
    return Result("hf-transformers", elapsed, len(prompts), sum(map(len, prompts)), useful, generated), tokens


def print_table(results: list[Result]) -> None:
    print(f"{'engine':<16} {'elapsed s':>10} {'output tok/s':>13} {'total tok/s':>12} {'computed tok':>13}")
    for r in results:
        print(f"{r.engine:<16} {r.elapsed_s:>10.2f} {r.output_tok_s:>13.1f} {r.total_tok_s:>12.1f} "
              f"{r.generated_tokens:>13}")
    if len(results) == 2:
        ratio = results[0].output_tok_s / results[1].output_tok_s
        print(f"ratio dsinfer / HF (useful output tok/s): {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from dsinfer import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
    config = llm.engine.model_config
    prompts, lengths = make_workload(args, config.vocab_size)
    print(f"model {config.served_model_name} ({config.path}), dtype {config.dtype}, device {args.device}, "
          f"threads {torch.get_num_threads()}; {len(prompts)} prompts x {args.input_len} tokens, "
          f"outputs {min(lengths)}-{max(lengths)} (sum {sum(lengths)}), ignore_eos={args.ignore_eos}")
    hf_model = load_hf(config.path, config.dtype, args.device) if args.compare_hf else None
    ours = hf = None
    for _ in range(args.repeat):
        run, our_tokens = run_dsinfer(llm, prompts, lengths, args.ignore_eos)
        ours = run if ours is None or run.elapsed_s < ours.elapsed_s else ours
        print(f"  dsinfer run: {run.elapsed_s:.2f} s")
        if hf_model is not None:
            run, hf_tokens = run_hf(hf_model, args.device, prompts, lengths, args.batch_hf or len(prompts),
                                    args.ignore_eos)
            hf = run if hf is None or run.elapsed_s < hf.elapsed_s else hf
            print(f"  HF run: {run.elapsed_s:.2f} s")
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    results = [ours]
    if hf is not None:
        results.append(hf)
        same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
        print(f"greedy outputs identical to HF: {same}/{len(prompts)}")
        report["ratio_output_tok_s"] = ours.output_tok_s / hf.output_tok_s
        report["identical_outputs"] = same
    print_table(results)
    report["results"] = [asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s}
                         for r in results]
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
