"""``dsinfer bench throughput | latency | serve | sweep | plot`` (also ``python -m dsinfer.bench ...``), with vLLM's
flag names."""

from __future__ import annotations

import argparse
import logging
import sys

from dsinfer.bench.datasets import DATASETS


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset-name", default="random", choices=DATASETS)
    p.add_argument("--dataset-path", default=None, help="the JSONL file of --dataset-name jsonl")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (shared-prefix: the suffix)")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ r)")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random ids before every random prompt")
    p.add_argument("--random-vocab-size", type=int, default=32000, help="random ids are drawn below this")
    p.add_argument("--shared-prefix-len", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--shared-prefix-num-prefixes", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="SLOs a good request meets, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: every request generates its max_tokens)")
    p.add_argument("--label", default="", help="the configuration's name in results and plots (default: model)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs behind the URL (the plot's per-GPU divisor)")
    p.add_argument("--result-dir", default=None, help="save the result JSON here")
    p.add_argument("--disable-tqdm", action="store_true")


def _config(args, rate: float, concurrency: int | None):
    from dsinfer.bench.serve import ServeConfig, first_model

    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    model = args.model or first_model(base_url, args.api_key)
    return ServeConfig(base_url, model, rate, args.burstiness, concurrency, args.seed, args.api_key, args.timeout,
                       args.ignore_eos, args.temperature, not args.disable_tqdm)


def _quiet_http_log() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise


def cmd_serve(args) -> int:
    import json

    from dsinfer.bench.datasets import build_requests
    from dsinfer.bench.metrics import format_table, parse_goodput
    from dsinfer.bench.serve import benchmark, save_result

    _quiet_http_log()
    slos = parse_goodput(args.goodput)
    requests = build_requests(args)
    cfg = _config(args, args.request_rate, args.max_concurrency)
    result = benchmark(cfg, requests, slos, args.label, args.num_gpus, args.dataset_name)
    print(format_table(result))
    if args.result_dir:
        print(f"result: {save_result(result, args.result_dir, args.result_filename)}")
    if result["failed"]:
        print(f"{result['failed']} failed; first error: {json.dumps(next(e for e in result['errors'] if e))}",
              file=sys.stderr)
    return 0 if result["completed"] else 1


def cmd_sweep(args) -> int:
    from dsinfer.bench.datasets import build_requests
    from dsinfer.bench.metrics import parse_goodput
    from dsinfer.bench.sweep import parse_grid, run_sweep, sweep_points

    rates = parse_grid(args.request_rates, float, "--request-rates") if args.request_rates else None
    concurrencies = parse_grid(args.concurrencies, int, "--concurrencies") if args.concurrencies else None
    points = sweep_points(rates, concurrencies)
    _quiet_http_log()
    slos = parse_goodput(args.goodput)
    base = _config(args, float("inf"), None)
    def requests_for(i: int):
        return build_requests(argparse.Namespace(**(vars(args) | {"seed": args.seed + i})))

    _, png = run_sweep(base, requests_for, points, slos, args.label or base.model, args.num_gpus,
                       args.dataset_name, args.result_dir)
    print(f"pareto plot: {png}")
    return 0


def cmd_plot(args) -> int:
    from dsinfer.bench.pareto import load_points, pareto_frontier, plot_pareto

    points = load_points(args.results)
    path = plot_pareto(points, args.output, args.title)
    for p in pareto_frontier(points):
        print(f"frontier: {p.label} {p.knob}: {p.per_user:.1f} tok/s/user, {p.per_gpu:.1f} tok/s/GPU")
    print(f"wrote {path}")
    return 0


def _add_offline_args(p: argparse.ArgumentParser, output_len: int) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy (random weights)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3, help="timed runs; the fastest is reported")
    p.add_argument("--output-json", default=None, help="also write the figures here")


def _offline_llm(args):
    from dsinfer.entrypoints.llm import LLM

    kwargs = {"device": args.device} if args.device else {}
    return LLM(args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
               seed=args.seed, **kwargs)


def _report(figures: dict, path: str | None) -> None:
    import json

    for name, value in figures.items():
        print(f"{name + ':':<28}{value:>14.2f}" if isinstance(value, float) else f"{name + ':':<28}{value:>14}")
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(figures, indent=1) + "\n")


def cmd_throughput(args) -> int:
    from dsinfer.bench.offline import run_throughput

    llm = _offline_llm(args)
    r = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.seed, args.num_iters_warmup,
                       args.num_iters, use_tqdm=not args.disable_tqdm)
    _report({"num_prompts": r.num_prompts, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
             "elapsed_s": r.elapsed_s, "output_throughput": r.output_throughput,
             "total_token_throughput": r.total_token_throughput}, args.output_json)
    return 0


def cmd_latency(args) -> int:
    from dsinfer.bench.offline import run_latency

    llm = _offline_llm(args)
    r = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.seed, args.num_iters_warmup,
                    args.num_iters)
    _report({"batch_size": r.batch_size, "input_len": r.input_len, "output_len": r.output_len,
             "prefill_ms": r.prefill_ms, "decode_step_ms": r.decode_step_ms, "total_ms": r.total_ms},
            args.output_json)
    return 0


def add_bench_parser(sub) -> None:
    """``bench`` and its subcommands on the ``dsinfer`` parser's subparsers."""
    _add_commands(sub.add_parser("bench", help="serving benchmarks, sweeps and Pareto plots"))


def _add_commands(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser("throughput", help="offline: random prompts at once, tokens/s")
    _add_offline_args(throughput, output_len=128)
    throughput.add_argument("--num-prompts", type=int, default=100)
    throughput.add_argument("--disable-tqdm", action="store_true")
    throughput.set_defaults(func=cmd_throughput, num_iters=1, num_iters_warmup=0)
    latency = bench_sub.add_parser("latency", help="offline: one batch, prefill and per-step decode time")
    _add_offline_args(latency, output_len=32)
    latency.add_argument("--batch-size", type=int, default=8)
    latency.set_defaults(func=cmd_latency)
    serve = bench_sub.add_parser("serve", help="one serving run against an OpenAI-compatible URL")
    _add_serve_args(serve)
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    serve.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    serve.add_argument("--result-filename", default=None, help="the JSON's name in --result-dir")
    serve.set_defaults(func=cmd_serve)
    sweep = bench_sub.add_parser("sweep", help="a grid of request rates or concurrencies, then a Pareto PNG")
    _add_serve_args(sweep)
    sweep.add_argument("--request-rates", default=None, help="comma-separated, e.g. 1,2,4,inf")
    sweep.add_argument("--concurrencies", default=None, help="comma-separated, e.g. 1,4,16,64")
    sweep.set_defaults(func=cmd_sweep, result_dir="bench-results")
    plot = bench_sub.add_parser("plot", help="redraw the Pareto PNG from saved result JSONs")
    plot.add_argument("results", nargs="+", help="result JSON files or directories of them")
    plot.add_argument("--output", required=True, help="the PNG to write")
    plot.add_argument("--title", default="")
    plot.set_defaults(func=cmd_plot)


def main(argv: list[str] | None = None) -> int:
    """``python -m dsinfer.bench``: the same commands as ``dsinfer bench``."""
    parser = argparse.ArgumentParser(prog="python -m dsinfer.bench", description=__doc__)
    _add_commands(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
