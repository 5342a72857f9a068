"""Decode speed of ``LLM.generate`` stepping in its side thread against the same loop on the calling thread (issue 45).

``generate`` steps the engine in a thread of its own so that a hung step raises ``StepTimeoutError`` instead of
hanging the caller. Three modes, the same LLM, prompt and greedy tokens, run in rounds that rotate their order (the
machine is shared: a slow moment hits every mode alike, and each round gives one paired ratio):
- ``main``: the step loop on the calling thread (``generate`` with its side thread taken out);
- ``side``: ``generate`` as it is (a side thread; the caller first gives up its OpenMP pool: ``openmp_pool``);
- ``side-two-pools``: the side thread with the caller's OpenMP pool kept (the cause of the slowdown).
Before each run the calling thread runs one parallel torch op, so that it holds a pool as it does after ``LLM()``.
Prints each run's decode tok/s (new tokens / wall time, a short prompt), each mode's best and median and its median
paired ratio to ``main``; ``--json`` writes them.

    PYTHONPATH=. python benchmarks/step_thread.py [--model GGUF_OR_DIR] [--tokens 64] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from unittest import mock

MODES = ("main", "side", "side-two-pools")
PROMPT = "Story number 1: once upon a time, in a land far away,"


def decode_tok_s(llm, mode: str, tokens: int) -> float:
    import torch

    from dsinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    torch.ones(1 << 20).add_(1.0)  # a parallel region here: this thread holds an OpenMP pool, as after LLM()
    with _mode(llm, mode):
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        return tokens / (time.perf_counter() - start)


def _mode(llm, mode: str):
    from dsinfer.entrypoints import llm as llm_module

    if mode == "main":  # generate's own loop, on this thread
        return mock.patch.object(llm, "_step_until_done", llm._drain_into)
    if mode == "side-two-pools":
        return mock.patch.object(llm_module, "release_thread_pool", lambda: False)
    return contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--tokens", type=int, default=64, help="greedy new tokens per run")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of the three modes, order rotated")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="`--modes main` runs on an older tree too (PYTHONPATH=that tree): before / after")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    modes = tuple(args.modes)

    from dsinfer import LLM

    llm = LLM(args.model, enable_prefix_caching=False) if args.model else LLM(enable_prefix_caching=False)
    for mode in modes:  # warm-up: every mode once
        decode_tok_s(llm, mode, 8)
    runs: dict[str, list[float]] = {mode: [] for mode in modes}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            runs[mode].append(decode_tok_s(llm, mode, args.tokens))
        print(f"round {r}: " + "  ".join(f"{m} {runs[m][-1]:.1f}" for m in modes)
              + f"  (load {os.getloadavg()[0]:.2f})")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    summary = {}
    for mode in modes:
        ratios = [x / m for x, m in zip(runs[mode], runs.get("main", runs[mode]))]
        summary[mode] = {"tok_s": runs[mode], "best_tok_s": max(runs[mode]),
                         "median_tok_s": statistics.median(runs[mode]),
                         "median_ratio_to_main": statistics.median(ratios)}
        print(f"{mode:>15}: best {summary[mode]['best_tok_s']:.1f} tok/s, median {summary[mode]['median_tok_s']:.1f}"
              f", median paired ratio to main {summary[mode]['median_ratio_to_main']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
