"""Where the host's time goes in the offline engine's steps on the GPU: the mean wall time per decode step of each
phase (schedule, build inputs, load the graph's inputs, replay, sample, wait for the result, process the outputs),
for B prompts of a given context decoding 128 tokens each (dummy weights). A phase that waits for the GPU where it
should not shows up as time the others do not explain; run it on two trees to compare.

    python benchmarks/engine_phases.py --model benchmarks/configs/llama-3.1-8b --batch 256
"""

from __future__ import annotations

import argparse
import collections
import functools
import shutil
import tempfile
import time
from pathlib import Path

import torch


def timed(table: dict, name: str, fn, decode: list[bool]):
    """``fn`` timed into ``table[name]`` while the latest launched step was a decode step (one token a request):
    a prefill step's eager launches can fill the GPU's queue and block anywhere, which says nothing here."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if decode[0]:
                entry = table[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - started
    return wrapper


def is_decode(step) -> bool:
    """A launch's argument, this tree's plan or an older tree's scheduler output: one token for every request."""
    counts = getattr(step, "num_scheduled_tokens", None)
    if counts is not None:
        return all(n == 1 for n in counts.values())
    return all(item.num_new_tokens == 1 for item in step.scheduled)


def main(argv=None) -> None:
    from dsinfer import LLM, SamplingParams
    from dsinfer.runner import model_runner

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dsinfer-phases-"))
    shutil.copy(args.model / "config.json", workdir / "config.json")
    llm = LLM(str(workdir), load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=4096,
              max_num_seqs=args.batch, enable_prefix_caching=False)
    engine, runner = llm.engine, llm.engine.runner
    table: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    decode = [False]
    engine.scheduler.schedule = timed(table, "schedule", engine.scheduler.schedule, decode)
    engine._process = timed(table, "process outputs", engine._process, decode)
    launch = timed(table, "launch (all of it)", runner.launch, decode)

    def marked_launch(step):
        decode[0] = is_decode(step)
        return launch(step)

    runner.launch = marked_launch
    for name in ("_forward", "_sample", "_fill_placeholders", "prepare"):
        if hasattr(runner, name):
            setattr(runner, name, timed(table, f"launch: {name.strip('_')}", getattr(runner, name), decode))
    if runner.graphs is not None:
        runner.graphs.load_inputs = timed(table, "forward: load graph inputs", runner.graphs.load_inputs, decode)
        runner.graphs.replay = timed(table, "forward: replay", runner.graphs.replay, decode)
    model_runner.StepHandle.result = timed(table, "wait for the result", model_runner.StepHandle.result, decode)
    gen = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.context,), generator=gen).tolist()}
               for _ in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    table.clear()
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - started
    steps = table["launch (all of it)"][0]
    print(f"B={args.batch}, context {args.context}: {wall:.2f} s; {steps} decode steps, phases per decode step:")
    print("| phase | calls | ms per step |\n| --- | --- | --- |")
    for name, (calls, seconds) in table.items():
        print(f"| {name} | {calls} | {seconds * 1e3 / steps:.3f} |")


if __name__ == "__main__":
    main()
