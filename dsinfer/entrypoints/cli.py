"""``dsinfer`` command line: generate | chat | serve | router | env | bench | eval | kvstore."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from dsinfer import envs


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="gguf | int8 | int4 (weight-only, CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 | fp8_e5m2")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many GPUs (under torchrun / SLURM: the job's WORLD_SIZE)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)


def _engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, max_model_len=args.max_model_len, load_format=args.load_format, seed=args.seed,
                kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                device=args.device, quantization=getattr(args, "quantization", None))


def _make_llm(args):
    from dsinfer.entrypoints.llm import LLM

    return LLM(args.model, **_engine_kwargs(args))


def _follow(args) -> int | None:
    """A launched job's rank >= 1 follows rank 0's engine (-> its exit code); None: this process runs it."""
    from dsinfer.engine.arg_utils import EngineArgs
    from dsinfer.entrypoints.launch import follow_if_launched

    return follow_if_launched(EngineArgs(model=args.model, **_engine_kwargs(args)), "offline")


def _sampling(args):
    from dsinfer.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


def cmd_generate(args) -> int:
    params = _sampling(args)  # bad flag values fail before the model loads
    followed = _follow(args)
    if followed is not None:
        return followed
    llm = _make_llm(args)
    started = time.perf_counter()
    out = llm.generate(args.text, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - started
    print(out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _sampling(args)
    followed = _follow(args)
    if followed is not None:
        return followed
    llm = _make_llm(args)
    if args.text:
        print(llm.chat([{"role": "user", "content": args.text}], params, use_tqdm=False)[0].outputs[0].text)
        return 0
    from dsinfer.entrypoints.chat_repl import run_repl

    return run_repl(llm, params)


def cmd_env(args) -> int:
    for var in envs.all_vars():
        current = var.raw if var.raw is not None else "(unset)"
        print(f"{var.name}  [{var.type_name}, default {var.default!r}]  current: {current}\n    {var.doc}")
    return 0


def cmd_kvstore_gc(args) -> int:
    """One GC sweep of a KV store directory (every model's entries): expired and invalid entries, stale
    temporary files, then LRU down to the low watermark when ``--max-gb`` is given and passed."""
    from dsinfer.kvstore.gc import collect

    root = Path(args.dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"kvstore gc: {args.dir!r} is not a directory")
    if args.max_gb is not None and not args.max_gb > 0:
        raise ValueError(f"kvstore gc: --max-gb must be > 0, got {args.max_gb}")
    capacity = None if args.max_gb is None else int(args.max_gb * (1 << 30))
    r = collect(root, capacity, args.high, args.low)
    print(f"{root}: {r.entries} entries ({r.bytes / (1 << 20):.1f} MiB) kept; expired {r.expired}, evicted "
          f"{r.evicted}, corrupt {r.corrupt}, stale temporary files {r.temp_removed}")
    return 0


def cmd_serve(args) -> int:
    from dsinfer.server.cli import run_serve

    return run_serve(args) or 0


def cmd_router(args) -> int:
    from dsinfer.router.cli import run_router

    return run_router(args, getattr(args, "serve_args", []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer", description="dsinfer: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="raw completion of TEXT")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.add_argument("text")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="one chat answer to TEXT, or an interactive chat without TEXT")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.add_argument("text", nargs="?")
    chat.set_defaults(func=cmd_chat)
    env = sub.add_parser("env", help="list every DSINFER_* environment variable")
    env.set_defaults(func=cmd_env)
    kvstore = sub.add_parser("kvstore", help="KV cache store upkeep").add_subparsers(dest="action", required=True)
    gc = kvstore.add_parser("gc", help="sweep a store directory (expired, invalid, least recently used entries)")
    gc.add_argument("dir", help="the directory (kv_store's dir; shared by any number of engines)")
    gc.add_argument("--max-gb", type=float, default=None, help="the directory's budget in GiB (default: none)")
    gc.add_argument("--high", type=float, default=0.95, help="evict past this fraction of --max-gb ...")
    gc.add_argument("--low", type=float, default=0.85, help="... down to this fraction")
    gc.set_defaults(func=cmd_kvstore_gc)
    serve = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server")
    try:
        from dsinfer.server.cli import add_serve_args
    except ImportError:  # server extras not installed
        serve.add_argument("model", nargs="?")
    else:
        add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    router = sub.add_parser("router", help="load balancer over dsinfer serve replicas (DP, prefill/decode)",
                            description="flags for launched replicas' dsinfer serve go after --")
    try:
        from dsinfer.router.cli import add_router_args
    except ImportError:  # server extras not installed
        pass
    else:
        add_router_args(router)
    router.set_defaults(func=cmd_router)
    from dsinfer.bench.cli import add_bench_parser
    from dsinfer.eval.cli import add_eval_parser

    add_bench_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        try:
            from dsinfer.server.cli import vllm_spelling
        except ImportError:  # server extras not installed
            pass
        else:
            argv = ["serve", *vllm_spelling(argv[1:])]  # `vllm serve --tensor_parallel_size=1` spellings
    serve_args: list[str] = []
    if argv[:1] == ["router"] and "--" in argv:  # the launched replicas' serve flags
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    args.serve_args = serve_args
    try:
        logging.basicConfig(level=envs.LOG_LEVEL.get(), format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that quit early (e.g. `| head`)
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
