"""Host time of one engine decode step with no model: scheduler, plan, the worker's request table and inputs, the
sampler on zero logits, the engine's bookkeeping, for B requests of a given context (a tiny random Llama on CPU
whose forward is replaced by zero logits). It runs on an older tree too (run it from that tree's root with
``PYTHONPATH=.``), so two trees compare on one machine; each step loop's start-up heap is frozen as
``LLM.generate`` freezes it.

    python benchmarks/host_step.py --batch 256 --context 1000
    python benchmarks/host_step.py --profile 30     # where the time goes (cProfile slows each call)
    python benchmarks/host_step.py --no-prefix-caching   # as the GPU benchmarks' latency runs
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import tempfile
import time

import torch


def main(argv=None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsinfer import LLM, SamplingParams
    from dsinfer.engine.sampling_params import RequestOutputKind

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N functions of most own time over the timed steps (cProfile)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    path = tempfile.mkdtemp(prefix="dsinfer-host-step-")
    torch.manual_seed(0)
    vocab = 256
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=args.context + args.steps + 64)).save_pretrained(path)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=args.batch * (args.context // 16 + 20),
              max_num_seqs=args.batch, max_num_batched_tokens=16384, async_scheduling=True,
              enable_prefix_caching=not args.no_prefix_caching)
    engine = llm.engine

    def zero_logits(inputs):  # no model: a logits row per sampled position
        return torch.zeros(max(len(inputs.sample_rows), 1), vocab)

    engine.runner._forward = zero_logits
    rng = random.Random(0)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.context)]},
                           SamplingParams(max_tokens=args.steps + 40, temperature=0.0, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))  # as LLM.generate
    for _ in range(20):  # the prompts, then a few decode steps
        engine.step()
    gc.freeze()
    profiler = cProfile.Profile() if args.profile else None
    started, started_cpu = time.perf_counter(), time.thread_time()
    if profiler:
        profiler.enable()
    for _ in range(args.steps):
        engine.step()
    if profiler:
        profiler.disable()
    gc.unfreeze()
    # the thread's CPU time beside the wall: on a shared machine the wall also counts other processes' turns
    print(f"host ms per decode step, B={args.batch}, context {args.context}: "
          f"{(time.perf_counter() - started) * 1e3 / args.steps:.2f} wall, "
          f"{(time.thread_time() - started_cpu) * 1e3 / args.steps:.2f} CPU")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
