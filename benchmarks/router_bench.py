"""``dsinfer router`` on one machine: two replicas (each with about half the GPU) behind the router, a workload of
shared long prefixes and mixed output lengths at a fixed request rate, one run per policy (round_robin,
load_aware, prefix_aware), then prefill/decode disaggregation (one prefill + one decode replica sharing a
directory KV store) against those two mixed replicas. Prints one table (throughput, TTFT p50 / p99, TPOT p99)
and writes every run's figures to ``--out``.

Each run draws its own prefixes (seed + run index), so a run never hits what an earlier one left in the caches.

H200 (the issue's run):
    python benchmarks/router_bench.py --model benchmarks/configs/llama-3.1-8b --gpu-memory-utilization 0.45 \\
        --num-prompts 512 --request-rate 8 --prefix-len 2048 --num-prefixes 16 -- --load-format dummy --dtype bfloat16
A model directory without a tokenizer (benchmarks/configs/*) runs with the bundled model's.
CPU smoke (the bundled model, seconds):
    python benchmarks/router_bench.py --cpu --prefix-len 160 --suffix-len 8 --num-prefixes 2 \\
        --num-prompts 6 --output-lens 2,4 --request-rate 4 --max-model-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from dsinfer.bench.datasets import BenchRequest, shared_prefix_requests
from dsinfer.bench.serve import ServeConfig, benchmark, first_model
from dsinfer.router import launch

POLICIES = ("round_robin", "load_aware", "prefix_aware")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--tokenizer", default=None,
                   help="the replicas' and the router's tokenizer (default: the model's; a model directory without "
                        "one, such as benchmarks/configs/*, gets the bundled model's: the prompts are token ids)")
    p.add_argument("--cpu", action="store_true",
                   help="a machine without a GPU: no --gpu-memory-utilization (the replicas run on their default "
                        "device, the CPU there)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="each replica's share of the GPU")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--request-rate", type=float, default=8.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--output-lens", default="32,128,512", help="output lengths, drawn uniformly per request")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--no-pd", action="store_true", help="skip the prefill/decode run")
    p.add_argument("--kv-dir", default=None, help="the P/D shared store (default: a folder in /dev/shm or /tmp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="router_bench.json")
    p.add_argument("--log-dir", default="router-bench-logs")
    p.add_argument("serve_args", nargs="*", help="more dsinfer serve flags for every replica (after --)")
    return p.parse_args(argv)


def workload(args: argparse.Namespace, vocab_size: int, run: int) -> list[BenchRequest]:
    reqs = shared_prefix_requests(args.num_prompts, args.num_prefixes, args.prefix_len, args.suffix_len, 1,
                                  vocab_size, seed=args.seed + run)
    lens = [int(x) for x in args.output_lens.split(",")]
    rng = np.random.default_rng(args.seed + run)
    order = rng.permutation(len(reqs))  # the prefixes interleaved at random, not in turn
    return [BenchRequest(reqs[i].prompt, None, reqs[i].prompt_len, int(rng.choice(lens))) for i in order]


def _vocab_size(model: str | None) -> int:
    from dsinfer.models.loader.resolve import resolve_model_dir

    config = json.loads((resolve_model_dir(model, "auto")[0] / "config.json").read_text())
    return int(config["vocab_size"])


def _tokenizer(model: str | None) -> str | None:
    """None where the model has its own tokenizer; else the bundled model's (a config-only benchmark model)."""
    from dsinfer.models.loader.resolve import resolve_model_dir

    if (resolve_model_dir(model, "auto")[0] / "tokenizer.json").exists():
        return None
    return str(resolve_model_dir(None, "auto")[0])


def _serve_args(args: argparse.Namespace, extra: list[str] = ()) -> list[str]:
    out = ([args.model] if args.model else []) + ["--max-model-len", str(args.max_model_len), "--log-level",
                                                   "warning"]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    if not args.cpu:
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return out + list(extra) + list(args.serve_args)


def _router(args: argparse.Namespace, log_dir: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = launch.free_port()
    cmd = [sys.executable, "-m", "dsinfer.router", "--port", str(port), "--log-level", "warning", *flags]
    if args.model:
        cmd += ["--model", args.model]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    log = (log_dir / f"router-{port}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}: see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the router did not become healthy in 120s")
        time.sleep(0.3)


def run_one(args: argparse.Namespace, log_dir: Path, label: str, flags: list[str], requests) -> dict:
    proc, url = _router(args, log_dir, flags)
    try:
        cfg = ServeConfig(base_url=url, model=first_model(url, None), request_rate=args.request_rate,
                          seed=args.seed, progress=False)
        result = benchmark(cfg, requests, {}, label=label)
        text = httpx.get(f"{url}/metrics", timeout=10).text
        result["router_decisions"] = [line for line in text.splitlines()
                                      if line.startswith("dsinfer_router_routing_decisions_total")]
    finally:
        proc.terminate()
        proc.wait(60)
    return result


def table(results: list[dict]) -> str:
    head = f"{'run':<22}{'done':>6}{'fail':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}" \
           f"{'TPOT p99':>10}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r['label']:<22}{r['completed']:>6}{r['failed']:>6}{r['request_throughput']:>8.2f}"
                    f"{r['output_throughput']:>11.1f}{r['median_ttft_ms']:>8.0f}ms{r['p99_ttft_ms']:>8.0f}ms"
                    f"{r['p99_tpot_ms']:>8.1f}ms")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.tokenizer = args.tokenizer or _tokenizer(args.model)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab = _vocab_size(args.model)
    if args.tokenizer:  # token ids the replicas' tokenizer knows
        from tokenizers import Tokenizer

        vocab = min(vocab, Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json")).get_vocab_size())
    results, run = [], 0
    mixed = launch.launch(["mixed", "mixed"], _serve_args(args), log_dir)
    try:
        launch.wait_healthy(mixed, 900)
        for policy in args.policies.split(","):
            run += 1
            flags = ["--replica", *[r.url for r in mixed], "--policy", policy]
            results.append(run_one(args, log_dir, f"2 mixed, {policy}", flags, workload(args, vocab, run)))
            print(table(results[-1:]), flush=True)
    finally:
        launch.stop(mixed)
    if not args.no_pd:
        base = Path(args.kv_dir or tempfile.mkdtemp(prefix="dsinfer-pd-", dir="/dev/shm" if Path("/dev/shm").is_dir()
                                                     else None))
        base.mkdir(parents=True, exist_ok=True)
        store = json.dumps({"dir": str(base), "dir_gb": 32, "host_gb": 0})
        pd = launch.launch(["prefill", "decode"], _serve_args(args, ["--kv-store", store]), log_dir)
        try:
            launch.wait_healthy(pd, 900)
            run += 1
            flags = ["--prefill", pd[0].url, "--decode", pd[1].url, "--policy", "load_aware"]
            results.append(run_one(args, log_dir, "1 prefill + 1 decode", flags, workload(args, vocab, run)))
        finally:
            launch.stop(pd)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nrequest rate {args.request_rate}/s, {args.num_prompts} requests, {args.num_prefixes} prefixes of "
          f"{args.prefix_len} tokens + {args.suffix_len}, output lengths {args.output_lens}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
