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
    if args.prompts_per_concurrency is not None and (args.prompts_per_concurrency < 1 or not concurrencies):
        raise ValueError("--prompts-per-concurrency takes a positive number and needs --concurrencies")
    base = _config(args, float("inf"), None)

    def requests_for(i: int):
        count = args.num_prompts  # a fixed count would keep one user busy for as long as 256 users
        if args.prompts_per_concurrency:
            count = args.prompts_per_concurrency * points[i][1]
        return build_requests(argparse.Namespace(**(vars(args) | {"seed": args.seed + i, "num_prompts": count})))

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
    import json

    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy (random weights)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--hf-overrides", type=json.loads, default=None,
                   help='JSON merged into config.json, e.g. \'{"num_hidden_layers": 8}\'')
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3, help="timed runs; the fastest is reported")
    p.add_argument("--output-json", default=None, help="also write the figures here")


def _offline_llm(args, **extra):
    import torch

    from dsinfer.entrypoints.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {"device": args.device} if args.device else {}
    for name in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "deterministic", False):
        kwargs["deterministic"] = True
    kwargs |= {"max_model_len": args.max_model_len} | extra
    return LLM(args.model, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
               hf_overrides=args.hf_overrides, kv_cache_dtype=args.kv_cache_dtype, **kwargs)


def _report(figures: dict, path: str | None) -> None:
    import json

    for name, value in figures.items():
        if value is None or isinstance(value, dict | list | str):  # the long ones are printed where they are made
            if name == "model":
                print(f"model: {value}")
            continue
        print(f"{name + ':':<28}{value:>14.2f}" if isinstance(value, float) else f"{name + ':':<28}{value:>14}")
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(figures, indent=1) + "\n")


def _check_positive(args, *names: str) -> None:
    for name in names:
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def cmd_throughput(args) -> int:
    from dsinfer.bench.offline import output_lengths, run_throughput

    _check_positive(args, "num_prompts", "input_len")
    lengths = output_lengths(args.num_prompts, args.output_len, args.output_len_range, args.seed)
    extra = {} if args.max_model_len else {"max_model_len": args.input_len + max(lengths) + 16}
    ceilings = _ceilings(args) if args.roofline or _device_type(args) == "cuda" else None
    llm = _offline_llm(args, **extra)
    runner = llm.engine.runner
    breakdown = args.step_breakdown and runner.device.type == "cuda"
    figures: dict = {"model": str(llm.engine.model_config.path), "hf_overrides": args.hf_overrides}
    if args.compare_hf:
        figures |= _compare_hf(llm, args, lengths)
    r = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.seed, args.num_iters_warmup,
                       args.num_iters, use_tqdm=not args.disable_tqdm, output_len_range=args.output_len_range,
                       ignore_eos=args.ignore_eos,
                       before_last=(lambda: setattr(runner, "step_events", [])) if breakdown else None)
    figures |= {"num_prompts": r.num_prompts, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "elapsed_s": r.elapsed_s, "cpu_s": r.cpu_s, "output_throughput": r.output_throughput,
                "total_token_throughput": r.total_token_throughput}
    if "hf_output_throughput" in figures:
        figures["ratio_full_vs_hf_subset"] = r.output_throughput / figures["hf_output_throughput"]
    if ceilings is not None:
        figures |= _roofline(llm, ceilings, args.input_len, lengths, r.elapsed_s)
    if breakdown:
        figures["step_breakdown"] = _print_breakdown(runner)
    _report(figures, args.output_json)
    return 0


def _compare_hf(llm, args, lengths: list[int]) -> dict:
    """HF transformers and dsinfer on the first ``--hf-num-prompts`` prompts (``--hf-output-len`` tokens each)."""
    import time

    from dsinfer.bench.hf_compare import compare_subset
    from dsinfer.bench.offline import greedy_params, random_prompts

    count = args.hf_num_prompts or args.num_prompts
    prompts = random_prompts(count, args.input_len, llm.engine.model_config.vocab_size, args.seed)
    sub_lengths = [args.hf_output_len or n for n in lengths[:count]]

    def run_ours(prompts, lengths):
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm.engine.kv_manager.pool.reset_prefix_cache()
        started, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(inputs, [greedy_params(n, args.ignore_eos) for n in lengths], use_tqdm=False)
        return (time.perf_counter() - started, time.process_time() - cpu,
                [list(o.outputs[0].token_ids) for o in outs])

    device = llm.engine.runner.device.type
    figures = compare_subset(llm, device, args.load_format, args.hf_overrides, prompts, sub_lengths,
                             args.hf_batch_size, args.ignore_eos, run_ours)
    print(f"HF subset ({count} prompts x {args.input_len} in / {max(sub_lengths)} out): HF "
          f"{figures['hf_output_throughput']:.1f} useful output tok/s, dsinfer "
          f"{figures['dsinfer_subset_output_throughput']:.1f} ({figures['ratio_vs_hf']:.2f}x wall, "
          f"{figures['ratio_vs_hf_cpu']:.2f}x by CPU time); identical greedy "
          f"outputs {figures['identical_outputs']}/{count}, mean common prefix {figures['mean_common_prefix']:.1f}")
    return figures


def _device_type(args) -> str:
    import torch

    return torch.device(args.device).type if args.device else "cuda" if torch.cuda.is_available() else "cpu"


def _ceilings(args):
    """The device's ceilings, measured before the engine is built (its KV cache would leave no room)."""
    from dsinfer.bench.ceilings import measure_ceilings

    ceilings = measure_ceilings(_device_type(args))
    print(ceilings.describe(), flush=True)
    return ceilings


def _roofline(llm, ceilings, input_len: int, lengths: list[int], elapsed_s: float) -> dict:
    from dsinfer.bench.roofline import throughput_roofline

    figures = throughput_roofline(llm, ceilings, input_len, lengths, elapsed_s)
    print(figures["roofline_model"])
    print(f"roofline floor {figures['roofline_floor_s']:.4g} s (prefill {figures['roofline_prefill_floor_s']:.4g} "
          f"s at the matmul rate + {figures['roofline_decode_steps']} decode steps "
          f"{figures['roofline_decode_floor_s']:.4g} s at the bandwidth): {100 * figures['roofline_fraction']:.1f}% "
          "of the roofline")
    return figures


def _print_breakdown(runner) -> list:
    import torch

    from dsinfer.bench.steps import step_breakdown

    torch.cuda.synchronize()
    rows = step_breakdown(runner)
    runner.step_events = None
    print("where the last run's GPU time went:")
    for kind, n, sec in rows:
        print(f"  {kind:28s} {n:6d} steps {sec:8.2f} s ({1e3 * sec / max(n, 1):.3f} ms/step)")
    return [list(row) for row in rows]


STEP_BATCH_SIZES = [1, 16, 64, 128, 256]
STEP_PREFILL = ["512", "2048", "8192", "8x2048"]


def cmd_latency(args) -> int:
    if args.batch_sizes is not None or args.prefill is not None:
        return _latency_steps(args)
    from dsinfer.bench.offline import run_latency

    llm = _offline_llm(args)
    r = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.seed, args.num_iters_warmup,
                    args.num_iters)
    _report({"batch_size": r.batch_size, "input_len": r.input_len, "output_len": r.output_len,
             "prefill_ms": r.prefill_ms, "decode_step_ms": r.decode_step_ms, "total_ms": r.total_ms},
            args.output_json)
    return 0


def _latency_steps(args) -> int:
    """The runner's step tables (``steps.py``): decode at each batch size, each prefill, the GPU's idle time."""
    import json

    from dsinfer.bench.steps import parse_prefill, run_step_tables

    _check_positive(args, "context", "steps", *(["batch_sizes"] if args.batch_sizes else []))
    batch_sizes = STEP_BATCH_SIZES if args.batch_sizes is None else args.batch_sizes
    prefill = STEP_PREFILL if args.prefill is None else args.prefill
    max_tokens = max((n * length for n, length in map(parse_prefill, prefill)), default=0)
    extra = {"enable_prefix_caching": False, "max_prefill_graph_tokens": args.max_prefill_graph_tokens,
             "max_num_seqs": args.max_num_seqs or max(256, *batch_sizes),
             "max_num_batched_tokens": args.max_num_batched_tokens or max(2048, max_tokens)}
    ceilings = _ceilings(args)
    llm = _offline_llm(args, **extra)
    report = run_step_tables(llm, ceilings, batch_sizes, args.context, args.steps, prefill, args.idle_batch,
                             args.idle_profile)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(json.dumps(report | {"hf_overrides": args.hf_overrides}, indent=1) + "\n")
    return 0


def _add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="mixed output lengths drawn uniformly from [MIN, MAX] (seeded)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every request generates its output length (default)")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant mode (LLM(deterministic=True))")
    p.add_argument("--roofline", action="store_true", help="the roofline figures on CPU too (always on a GPU)")
    p.add_argument("--step-breakdown", action="store_true",
                   help="CUDA: GPU time of the last run's steps, prompt steps apart from decode steps by batch")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers generate on a subset (dummy weights: dsinfer's, copied in)")
    p.add_argument("--hf-num-prompts", type=int, default=None, help="HF's subset: this many prompts (default all)")
    p.add_argument("--hf-output-len", type=int, default=None, help="HF's subset: this output length")
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF's batch (default: the subset at once)")
    p.add_argument("--disable-tqdm", action="store_true")


def _add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help=f"the runner's decode step at each batch (default with --prefill: {STEP_BATCH_SIZES})")
    p.add_argument("--prefill", nargs="*", default=None, metavar="LEN|NxLEN",
                   help=f"the runner's prefill of each (default with --batch-sizes: {STEP_PREFILL}; none: skip)")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV each decode sequence holds")
    p.add_argument("--steps", type=int, default=50, help="decode steps timed back to back")
    p.add_argument("--idle-batch", type=int, default=256, help="CUDA: GPU idle between engine steps; 0: skip")
    p.add_argument("--idle-profile", type=int, default=0, metavar="N",
                   help="also the N functions of most own time in the idle run's host loop (cProfile)")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=2048,
                   help="prompt steps up to this many tokens run through piecewise CUDA graphs (0: eager)")


def add_bench_parser(sub) -> None:
    """``bench`` and its subcommands on the ``dsinfer`` parser's subparsers."""
    _add_commands(sub.add_parser("bench", help="serving benchmarks, sweeps and Pareto plots"))


def _add_commands(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser("throughput", help="offline: random prompts at once, tokens/s (and the "
                                      "roofline on a GPU)")
    _add_offline_args(throughput, output_len=128)
    _add_throughput_args(throughput)
    throughput.set_defaults(func=cmd_throughput, num_iters=1, num_iters_warmup=0)
    latency = bench_sub.add_parser("latency", help="offline: one batch, prefill and per-step decode time; with "
                                   "--batch-sizes / --prefill the runner's steps against their floors")
    _add_offline_args(latency, output_len=32)
    _add_latency_args(latency)
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
    sweep.add_argument("--prompts-per-concurrency", type=int, default=None,
                       help="a concurrency point sends this many prompts per user (default: --num-prompts each)")
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
