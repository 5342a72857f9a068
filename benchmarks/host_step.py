"""Host time of one engine decode step, with no forward: scheduler, plan, the worker's request table and inputs,
the sampling batch and the engine's bookkeeping, for B requests of a given context (a tiny random Llama on CPU,
its executor replaced by one that builds the step's inputs and returns a fixed token).

    python benchmarks/host_step.py --batch 256 --context 1000
    python benchmarks/host_step.py --profile 30     # where the time goes (cProfile slows each call)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time

import torch


class _Done:
    def __init__(self, plan):
        self.plan = plan

    def result(self):
        from dsinfer.core.outputs import RunnerOutput

        return RunnerOutput({rid: [7] for rid in self.plan.num_scheduled_tokens})


class HostOnlyExecutor:
    """The worker's host side of a step (request table, inputs, sampling batch); no forward."""

    def __init__(self, runner):
        self.runner = runner
        self.num_kv_blocks = runner.num_blocks

    def launch(self, plan):
        from dsinfer.runner.input_batch import build_sampling_batch

        inputs = self.runner.prepare(plan)
        build_sampling_batch(inputs.sample_rows, self.runner.vocab_size, self.runner.device)
        return _Done(plan)

    def execute(self, plan):
        return self.launch(plan).result()

    def shutdown(self):
        pass


def main(argv=None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsinfer import LLM, SamplingParams
    from dsinfer.engine.heap import startup_heap_frozen
    from dsinfer.engine.sampling_params import RequestOutputKind

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N functions of most own time over the timed steps (cProfile)")
    args = p.parse_args(argv)
    path = tempfile.mkdtemp(prefix="dsinfer-host-step-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=args.context + args.steps + 64)).save_pretrained(path)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=args.batch * (args.context // 16 + 20),
              max_num_seqs=args.batch, max_num_batched_tokens=16384, async_scheduling=True)
    engine = llm.engine
    engine.executor = HostOnlyExecutor(engine.runner)
    rng = random.Random(0)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(256) for _ in range(args.context)]},
                           SamplingParams(max_tokens=args.steps + 40, temperature=0.0, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))  # as LLM.generate
    for _ in range(20):  # the prompts, then a few decode steps
        engine.step()
    frozen = startup_heap_frozen()  # as LLM.generate runs its steps
    frozen.__enter__()
    profiler = cProfile.Profile() if args.profile else None
    started, started_cpu = time.perf_counter(), time.thread_time()
    if profiler:
        profiler.enable()
    for _ in range(args.steps):
        engine.step()
    if profiler:
        profiler.disable()
    frozen.__exit__(None, None, None)
    # the thread's CPU time beside the wall: on a shared machine the wall also counts other processes' turns
    print(f"host ms per decode step, B={args.batch}, context {args.context}: "
          f"{(time.perf_counter() - started) * 1e3 / args.steps:.2f} wall, "
          f"{(time.thread_time() - started_cpu) * 1e3 / args.steps:.2f} CPU")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
