"""A timeline of the offline engine's decode steps on the GPU (torch.profiler), to find what leaves the GPU idle
between steps: B prompts of a given context are prefilled and decoded a while, then ``--steps`` decode steps are
profiled. Prints the CUDA runtime calls by host time (a ``cudaHostAlloc``, ``cudaEventSynchronize`` or
``cudaStreamSynchronize`` where the host should only enqueue is the usual culprit), the GPU's gaps between
kernels longer than ``--gap-us`` with the runtime calls the host made meanwhile, and writes the Chrome trace
(``$OUT/step_timeline.json`` when ``OUT`` is set). Runs on older trees too (``PYTHONPATH`` at the tree).

    python benchmarks/step_timeline.py --model benchmarks/configs/llama-3.1-8b --batch 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> None:
    from dsinfer import LLM, SamplingParams
    from dsinfer.engine.sampling_params import RequestOutputKind

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gap-us", type=float, default=200.0)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no GPU timeline)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dsinfer-timeline-"))
    shutil.copy(args.model / "config.json", workdir / "config.json")
    llm = LLM(str(workdir), load_format="dummy", dtype="bfloat16", device=args.device, max_model_len=4096,
              max_num_seqs=args.batch, enable_prefix_caching=False)
    engine = llm.engine
    gen = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(args.batch):
        engine.add_request(f"t{i}", {"prompt_token_ids": torch.randint(0, vocab, (args.context,),
                                                                       generator=gen).tolist()}, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(10):  # decoding steadily
        engine.step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    engine.abort_all()
    events = list(prof.events())
    runtime = sorted((e for e in events if e.name.startswith("cuda") and e.device_type.name == "CPU"),
                     key=lambda e: e.time_range.start)
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    totals: dict[str, list] = {}
    for e in runtime:
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    print(f"B={args.batch}, context {args.context}: {args.steps} decode steps profiled")
    print("| CUDA runtime call | calls per step | host us per step |\n| --- | --- | --- |")
    for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"| {name} | {calls / args.steps:.1f} | {us / args.steps:.0f} |")
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > args.gap_us:
            during = [e.name for e in runtime if a.time_range.end <= e.time_range.start < b.time_range.start]
            gaps.append((gap, a.name, b.name, during))
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    print(f"GPU gaps over {args.gap_us:.0f} us: {len(gaps)}, {sum(g[0] for g in gaps) / 1e3:.2f} ms of "
          f"{span / 1e3:.2f} ms")
    for gap, before, after, during in sorted(gaps, reverse=True)[:8]:
        calls = ", ".join(f"{n} x{during.count(n)}" for n in dict.fromkeys(during))
        print(f"  {gap:.0f} us after {before[:40]} before {after[:40]}; host meanwhile: {calls[:200]}")
    if os.environ.get("OUT"):
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], "step_timeline.json"))


if __name__ == "__main__":
    main()
