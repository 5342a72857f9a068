"""``dsinfer eval parity | ppl | tasks | score``."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_TASK = Path(__file__).parent / "data" / "basic.jsonl"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (float32: the parity reference's)")
    p.add_argument("--quantization", default=None, help="gguf | int8 | int4: weight-only quantized linears (CPU)")
    p.add_argument("--max-model-len", type=int, default=None)


def _llm(args):
    from dsinfer.entrypoints.llm import LLM

    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, quantization=args.quantization)


def cmd_parity(args) -> int:
    from dsinfer.eval.parity import DEFAULT_PROMPTS, compare, format_table, random_prompts
    from dsinfer.eval.reference import load_reference

    llm = _llm(args)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None or args.random_prompts:
        vocab = llm.engine.model_config.vocab_size
        prompts = random_prompts(args.random_prompts or 4, args.prompt_len, vocab, args.seed)
    else:
        texts = Path(args.prompts).read_text().splitlines() if args.prompts else list(DEFAULT_PROMPTS)
        prompts = [tokenizer.encode(t) for t in texts if t.strip()]
    rows = compare(llm, load_reference(args.model), prompts)
    print(format_table(rows))
    worst = max(r.max_abs_diff for r in rows)
    if args.max_diff is not None and worst > args.max_diff:
        print(f"FAIL: max |dlogp| {worst:.3e} exceeds --max-diff {args.max_diff:.1e}")
        return 1
    return 0


def cmd_ppl(args) -> int:
    from dsinfer.eval.ppl import perplexity, transformers_perplexity

    text = Path(args.file).read_text()
    llm = _llm(args)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError(f"--model {args.model}: perplexity of a text needs the model's tokenizer; it has none")
    ids = tokenizer.encode(text)
    result = perplexity(llm, ids, args.max_length, args.stride, use_tqdm=True)
    print(f"dsinfer perplexity: {result.value:.4f} ({result.num_tokens} tokens scored, max length "
          f"{args.max_length}, stride {args.stride})")
    if args.reference:
        from dsinfer.eval.reference import load_reference

        ref = transformers_perplexity(load_reference(args.model), ids, args.max_length, args.stride)
        print(f"transformers perplexity: {ref:.4f} (difference {100 * (result.value / ref - 1):+.3f}%)")
    return 0


def cmd_tasks(args) -> int:
    from dsinfer.eval.tasks import format_scores, load_task, run_task, score_dir

    if Path(args.file).suffix in (".yaml", ".yml"):
        return _lm_eval_task(args)

    task = load_task(args.file)
    path = run_task(_llm(args), task, args.output_dir)
    print(f"generations: {path}")
    print(format_scores(score_dir(args.output_dir)))
    return 0


def _lm_eval_task(args) -> int:
    try:
        from dsinfer.eval.harness import run_lm_eval_task
    except ImportError as exc:
        raise ValueError(f"{args.file}: lm-eval task YAMLs need lm-eval (pip install lm-eval): {exc}") from None
    from lm_eval.utils import make_table

    results = run_lm_eval_task(_llm(args), args.file, args.output_dir, args.limit)
    print(make_table(results))
    print(f"results and samples: {args.output_dir}")
    return 0


def cmd_score(args) -> int:
    from dsinfer.eval.tasks import format_scores, score_dir

    print(format_scores(score_dir(args.output_dir)))
    return 0


def add_eval_parser(sub) -> None:
    """``eval`` and its subcommands on the ``dsinfer`` parser's subparsers."""
    ev = sub.add_parser("eval", help="parity with transformers, perplexity, accuracy on local tasks")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    parity = ev_sub.add_parser("parity", help="our prompt logprobs against transformers'")
    _add_model_args(parity)
    parity.add_argument("--prompts", default=None, help="a text file, one prompt a line (default: built in)")
    parity.add_argument("--random-prompts", type=int, default=0, help="N random-id prompts instead of text")
    parity.add_argument("--prompt-len", type=int, default=32, help="tokens of each random prompt")
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument("--max-diff", type=float, default=None, help="exit 1 when max |dlogp| exceeds this")
    parity.set_defaults(func=cmd_parity)
    ppl = ev_sub.add_parser("ppl", help="sliding-window perplexity of a text file")
    ppl.add_argument("file")
    _add_model_args(ppl)
    ppl.add_argument("--max-length", type=int, default=1024, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    ppl.add_argument("--reference", action="store_true", help="also compute transformers' figure")
    ppl.set_defaults(func=cmd_ppl)
    tasks = ev_sub.add_parser("tasks", help="run a JSONL task (save generations), then score it; or an lm-eval YAML")
    tasks.add_argument("file", nargs="?", default=str(DEFAULT_TASK),
                       help="our JSONL task (default: the bundled set) or an lm-eval task YAML over local data")
    tasks.add_argument("--limit", type=int, default=None, help="lm-eval YAMLs: the first N documents only")
    _add_model_args(tasks)
    tasks.add_argument("--output-dir", required=True, help="generations.jsonl and scores.json go here")
    tasks.set_defaults(func=cmd_tasks)
    score = ev_sub.add_parser("score", help="re-score the saved generations of `dsinfer eval tasks`")
    score.add_argument("output_dir")
    score.set_defaults(func=cmd_score)
