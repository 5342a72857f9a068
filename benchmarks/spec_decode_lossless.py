"""Sampled losslessness of speculative decoding, over many seeded trials on a small random Llama (CPU).

    python benchmarks/spec_decode_lossless.py [--trials 2000] [--k 2] [--temperature 0.7] [--top-p 0.9]

* rejection acceptance: the distribution of the first 3 generated tokens (each position, and the three
  together) with speculation matches sampling without it: two-sample chi-square, p > 0.001 (cells expected
  below 5 left out). Trials use distinct seeds on the two sides.
* exact acceptance: every seed's output is token for token the one without speculation.

The drafter proposes the request's greedy continuation (q one-hot, independent of the sampling noise), so the
2nd and 3rd tokens come from verifying steps where drafts are kept with p(d) or resampled. A random model's
next-token distribution is nearly flat over its vocabulary, so the requests sample among ``--allowed`` tokens
shaped by logit biases (which, with the temperature and top-p, act on p as every sampling rule does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer import LLM, SamplingParams  # noqa: E402
from dsinfer.engine.llm_engine import LLMEngine  # noqa: E402

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPT = [11, 12, 13, 14, 11, 12, 13]


class GreedyContinuation:
    """Proposes fixed tokens after every output (the prompt's greedy continuation)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, request, num_tokens):
        return self.tokens[:num_tokens]


def two_sample_p(a: torch.Tensor, b: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    pooled = (a + b).double() / 2
    keep = pooled >= min_expected
    a, b, pooled = a[keep].double(), b[keep].double(), pooled[keep]
    stat = (((a - pooled) ** 2 + (b - pooled) ** 2) / pooled).sum()
    return float(torch.special.gammaincc(torch.tensor((len(pooled) - 1) / 2.0), stat / 2)), int(keep.sum())


def constraints(args) -> dict:
    allowed = list(range(20, 20 + args.allowed))
    return {"allowed_token_ids": allowed, "logit_bias": {t: 2.0 - 0.4 * i for i, t in enumerate(allowed[:6])}}


def sample(llm: LLM, trials: int, seed0: int, args) -> list[tuple[int, ...]]:
    """The first 3 tokens of each trial (one more is generated, so that the step after the first token verifies
    two drafts: a step never verifies more drafts than the outputs a request may still give, less one)."""
    params = [SamplingParams(max_tokens=args.k + 2, temperature=args.temperature, top_p=args.top_p, seed=seed0 + i,
                             ignore_eos=True, **constraints(args)) for i in range(trials)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * trials, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[:3]) for o in outs]


def make_llm(path: str, trials: int, spec: dict | None, drafter=None) -> LLM:
    llm = LLM(path, num_kv_blocks=4 * trials + 64, max_num_seqs=min(trials, 512), enable_prefix_caching=False,
              speculative_config=spec)
    if drafter is not None:
        llm.engine = LLMEngine(llm.engine.config, llm.engine.tokenizer, drafter=drafter)
    return llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--allowed", type=int, default=8, help="tokens the requests sample among")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="tiny_llama_")
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    started = time.perf_counter()
    plain = make_llm(path, args.trials, None)
    (greedy,) = plain.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        max_tokens=args.k + 1, temperature=0.0, **constraints(args)), use_tqdm=False)
    drafter = GreedyContinuation(list(greedy.outputs[0].token_ids[1:]))
    ok = True
    for mode in ("rejection", "exact"):
        spec = make_llm(path, args.trials, {"num_speculative_tokens": args.k, "acceptance": mode}, drafter)
        seed0 = 0 if mode == "rejection" else 10 * args.trials
        got = sample(spec, args.trials, seed0, args)
        stats = spec.engine.get_stats()["spec_decode"]
        accepted = f"drafts kept {stats['num_accepted_tokens']} of {stats['num_draft_tokens']}"
        if mode == "exact":
            want = sample(plain, args.trials, seed0, args)
            same = sum(a == b for a, b in zip(got, want))
            print(f"exact: {same} of {args.trials} seeds token-identical ({accepted})")
            ok &= same == args.trials
            continue
        want = sample(plain, args.trials, 10 * args.trials + args.trials, args)  # other seeds
        print(f"rejection: {args.trials} trials a side, temperature {args.temperature}, top-p {args.top_p} "
              f"({accepted})")
        for position in range(3):
            p, cells = two_sample_p(torch.bincount(torch.tensor([t[position] for t in got]), minlength=256),
                                    torch.bincount(torch.tensor([t[position] for t in want]), minlength=256))
            print(f"  token {position + 1}: chi-square p = {p:.4f} over {cells} cells")
            ok &= p > 1e-3
        keys = sorted(set(got) | set(want))
        index = {k: i for i, k in enumerate(keys)}
        a, b = torch.zeros(len(keys)), torch.zeros(len(keys))
        for t in got:
            a[index[t]] += 1
        for t in want:
            b[index[t]] += 1
        p, cells = two_sample_p(a, b)
        print(f"  tokens 1-3 jointly: chi-square p = {p:.4f} over {cells} cells")
        ok &= p > 1e-3
    print(f"{'PASS' if ok else 'FAIL'} in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
