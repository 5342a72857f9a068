"""Decode step time through the whole engine, the model in this process (``uni``) against a worker process
(``mp``): what the plan's trip over the pipe (msgpack both ways) costs a step.

A batch of ``--batch`` prompts of ``--context`` tokens runs twice per backend: to ``--steps`` + 1 output tokens and
to 1; the difference over ``--steps`` is the time of a decode step (the prefill cancels out). Dummy weights.

    python benchmarks/executor_overhead.py --model benchmarks/configs/llama-3.1-8b --batch 64
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch


def decode_step_ms(model: Path, backend: str, args) -> float:
    from dsinfer import LLM, SamplingParams

    workdir = Path(tempfile.mkdtemp(prefix="dsinfer-executor-"))
    shutil.copy(model / "config.json", workdir / "config.json")
    llm = LLM(str(workdir), load_format="dummy", dtype="bfloat16", device=args.device, max_model_len=4096,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.batch,
              distributed_executor_backend=backend)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.context)]} for _ in range(args.batch)]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.engine.kv_manager.pool.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    run(8)  # warm-up
    best = min((run(args.steps + 1) - run(1)) * 1e3 / args.steps for _ in range(args.repeat))
    llm.engine.shutdown()
    llm.engine = None  # the in-process model's memory goes before the next backend loads
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("benchmarks/configs/llama-3.1-8b"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = {backend: decode_step_ms(args.model, backend, args) for backend in ("uni", "mp")}
    print(f"| backend | decode step ms, b={args.batch}, {args.context} context |\n| --- | --- |")
    for backend, ms in rows.items():
        print(f"| {backend} | {ms:.3f} |")
    print(f"mp / uni: {rows['mp'] / rows['uni']:.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(dict(rows, batch=args.batch, context=args.context)))


if __name__ == "__main__":
    main()
