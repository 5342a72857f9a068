"""Single-stream decode speed with n-gram speculation on against off, on the bundled SmolLM2 (CPU, float32).

    python benchmarks/spec_decode_cpu.py [--k 4] [--lookup-min 2] [--lookup-max 4] [--max-tokens 128]
                                         [--repeats 2] [--threads N] [--json-out F]

Input-grounded prompts (copy or lightly rewrite a given passage, edit a given piece of code, continue a list the
prompt starts), greedy, one request at a time. Each prompt runs once to warm up, then ``--repeats`` times per
setting, alternating off / on so that a shared machine's load hits both alike. Decode tokens/s: (output tokens
- 1) / (time from the first output token to the last), the prefill left out; the median of the repeats. The
outputs with speculation must be token for token those without (greedy), checked for every prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer import LLM, SamplingParams  # noqa: E402

PASSAGE = ("The old lighthouse stood on the northern cliff for more than a century. Every night its keeper climbed "
           "the spiral stairs, trimmed the wick, and watched the beam sweep across the dark water. Ships passing the "
           "point relied on that light to find the narrow channel between the rocks, and sailors told stories of "
           "the keeper who never missed a night, not even during the great storm of the winter.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
PROMPTS = {
    "copy": "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "rewrite": "Rewrite the following passage in the present tense, changing nothing else:\n\n" + PASSAGE,
    "code-edit": "Rename the variable `subtotal` to `net` in this Python function and print the whole function:\n\n"
                 + CODE,
    "continue-list": "Continue this list of the months of the year, one per line:\nJanuary\nFebruary\nMarch\n",
}


def decode_run(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], float]:
    """One request alone: its output ids and the decode tokens/s (first output token to the last)."""
    engine = llm.engine
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    engine.add_request("r", text, params)
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            tokens = list(out.outputs[0].token_ids)
            if first is None and tokens:
                first = now
            last = now
    return tokens, (len(tokens) - 1) / (last - first) if len(tokens) > 1 and last > first else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json-out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    llms = {"off": LLM(dtype="float32"), "on": LLM(dtype="float32", speculative_config=spec)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows, identical = [], True
    for name, prompt in PROMPTS.items():
        outputs, speeds = {}, {"off": [], "on": []}
        for setting, llm in llms.items():
            outputs[setting] = decode_run(llm, prompt, params)[0]  # warm-up
        for _ in range(args.repeats):
            for setting, llm in llms.items():
                tokens, speed = decode_run(llm, prompt, params)
                assert tokens == outputs[setting], f"{name}/{setting}: greedy output changed between runs"
                speeds[setting].append(speed)
        same = outputs["on"] == outputs["off"]
        identical &= same
        off, on = statistics.median(speeds["off"]), statistics.median(speeds["on"])
        rows.append({"prompt": name, "tokens": len(outputs["off"]), "off_tok_s": off, "on_tok_s": on,
                     "speedup": on / off, "identical": same})
    stats = llms["on"].engine.get_stats()["spec_decode"]
    print(f"SmolLM2-135M float32 CPU, greedy, single stream, n-gram k={args.k} lookup "
          f"{args.lookup_min}..{args.lookup_max}, max_tokens {args.max_tokens}, median of {args.repeats}")
    print("| prompt | tokens | off tok/s | on tok/s | speedup | identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['prompt']} | {r['tokens']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['identical']} |")
    geo = statistics.geometric_mean([r["speedup"] for r in rows])
    print(f"geometric-mean speedup {geo:.2f}x; acceptance {stats['acceptance_rate']:.2f}, mean acceptance length "
          f"{stats['mean_acceptance_length']:.2f}, per position {stats['accepted_per_position']} of "
          f"{stats['num_drafts']} drafts; greedy identical: {identical}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "spec_decode": stats, "args": vars(args)}, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
