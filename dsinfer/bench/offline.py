"""``dsinfer bench throughput`` and ``dsinfer bench latency``: the offline engine (``LLM``) in this process.

throughput: every prompt submitted at once, greedy, EOS ignored unless ``--no-ignore-eos`` (so each produces
exactly its output length: ``--output-len``, or drawn uniformly from ``--output-len-range MIN MAX``, seeded);
output and total tokens/s over the wall time of the whole run, and the process CPU time of the run (less
sensitive than wall time to other processes with ``--threads 1``). On a GPU the run is set against its roofline
floor (``roofline.run_floor``: the prompts' FLOPs at the measured matmul rate plus the decode steps' weight and
KV bytes at the measured bandwidth). latency: one batch, timed end to end for a one-token run (the prefill, with
its first sampled token) and a full run; the decode step is the difference over the remaining steps (the runner's
step tables, ``steps.py``, time the steps themselves). Both take the fastest of ``--num-iters`` timed runs after
``--num-iters-warmup`` untimed ones (a shared machine only ever adds time); each run draws its own prompts (seed +
its index), so none hits the prefix cache a previous one filled; throughput warms the engine with two short
requests first (as ``benchmarks/throughput.py`` did).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from dsinfer.bench.datasets import random_requests


@dataclass(frozen=True)
class ThroughputResult:
    num_prompts: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    cpu_s: float = 0.0  # process CPU time of the timed run (all threads)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_token_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


@dataclass(frozen=True)
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_ms: float  # a run of one output token: the prompts' forward and the first sample
    total_ms: float  # a run of output_len tokens

    @property
    def decode_step_ms(self) -> float:
        """Per decode step: what the full run adds over the one-token run, over its output_len - 1 steps."""
        return (self.total_ms - self.prefill_ms) / max(self.output_len - 1, 1)


def greedy_params(output_len: int, ignore_eos: bool = True):
    """Greedy, ``output_len`` tokens (EOS ignored unless ``ignore_eos`` is False), no text."""
    from dsinfer.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos, detokenize=False)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    return [r.prompt for r in random_requests(num, input_len, 1, vocab_size, seed)]


def output_lengths(num: int, output_len: int, output_len_range: tuple[int, int] | None, seed: int) -> list[int]:
    """Each prompt's output length: ``output_len``, or uniform in ``[MIN, MAX]`` of ``output_len_range``."""
    if output_len_range is None:
        if output_len < 1:
            raise ValueError(f"--output-len must be at least 1, got {output_len}")
        return [output_len] * num
    low, high = output_len_range
    if not 1 <= low <= high:
        raise ValueError(f"--output-len-range needs 1 <= MIN <= MAX, got {low} {high}")
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num)]


def _prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in random_prompts(num, input_len, vocab_size, seed)]


def _fastest(run, warmup: int, iters: int) -> tuple[float, float]:
    """(wall s, CPU s) of the fastest of ``iters`` timed calls ``run(i)`` after ``warmup`` untimed ones; each call
    gets its own index, so it can draw its own prompts (the prefix cache would serve repeated ones)."""
    if iters < 1:
        raise ValueError(f"--num-iters must be at least 1, got {iters}")
    for i in range(warmup):
        run(i)
    times = []
    for i in range(warmup, warmup + iters):
        start, cpu = time.perf_counter(), time.process_time()
        run(i)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return min(times)


def _fastest_s(run, warmup: int, iters: int) -> float:
    return _fastest(run, warmup, iters)[0]


def _vocab(llm) -> int:
    return llm.engine.model_config.vocab_size


def run_throughput(llm, num_prompts: int, input_len: int, output_len: int, seed: int = 0, warmup: int = 0,
                   iters: int = 1, use_tqdm: bool = True, output_len_range: tuple[int, int] | None = None,
                   ignore_eos: bool = True, before_last=None) -> ThroughputResult:
    """``before_last``: called before the last timed run (``--step-breakdown`` starts recording there)."""
    lengths = output_lengths(num_prompts, output_len, output_len_range, seed)
    params = [greedy_params(n, ignore_eos) for n in lengths]
    produced = []

    def run(i: int) -> None:
        if before_last is not None and i == warmup + iters - 1:
            before_last()
        prompts = _prompts(num_prompts, input_len, _vocab(llm), seed + i)
        produced[:] = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=use_tqdm)]

    # two short requests first, whatever --num-iters-warmup says: kernels JIT-compiled and graphs captured on first
    # use stay out of the timed runs (a full warm-up run of the workload costs as much as a timed one)
    llm.generate(_prompts(2, input_len, _vocab(llm), seed + warmup + iters), greedy_params(4), use_tqdm=False)
    elapsed, cpu = _fastest(run, warmup, iters)
    return ThroughputResult(num_prompts, num_prompts * input_len, sum(produced), elapsed, cpu)


def run_latency(llm, batch_size: int, input_len: int, output_len: int, seed: int = 0, warmup: int = 1,
                iters: int = 3) -> LatencyResult:
    if output_len < 2:
        raise ValueError(f"--output-len must be at least 2 to time a decode step, got {output_len}")

    def runner(max_tokens: int, offset: int):
        params = greedy_params(max_tokens)
        return lambda i: llm.generate(_prompts(batch_size, input_len, _vocab(llm), seed + offset + i),
                                      params, use_tqdm=False)

    prefill = _fastest_s(runner(1, 0), warmup, iters)
    total = _fastest_s(runner(output_len, warmup + iters), warmup, iters)
    return LatencyResult(batch_size, input_len, output_len, 1000 * prefill, 1000 * total)
