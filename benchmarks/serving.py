"""Serving benchmark against any OpenAI-compatible server.

Sends ``--num-prompts`` streaming completions (random token prompts of ``--input-len``, ``--output-len``
tokens out, ``ignore_eos``) at a Poisson ``--request-rate`` or with ``--max-concurrency`` in flight, and
reports TTFT, TPOT and ITL percentiles (p50/p90/p99) plus request and token throughput, as JSON.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def _prompt(rng: random.Random, input_len: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(input_len)]


async def _one(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int]) -> Result:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    res, start = Result(prompt_tokens=len(prompt)), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


async def _run(args: argparse.Namespace) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = [_prompt(rng, args.input_len, args.vocab_size) for _ in range(args.num_prompts)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    async with httpx.AsyncClient(
        base_url=args.base_url,
        headers=headers,
        timeout=args.timeout,
        limits=httpx.Limits(max_connections=None),
    ) as client:

        async def limited(p: list[int]) -> Result:
            async with limit:
                return await _one(client, args, p)

        tasks, start = [], time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "config": {
            k: (str(v) if v == float("inf") else v)
            for k, v in vars(args).items()
            if k not in ("api_key", "json_out")
        },
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]),
        "e2e_latency_ms": _percentiles([r.latency for r in ok]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json-out", default=None, help="also write the JSON report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0][
            "id"
        ]
    results, duration = asyncio.run(_run(args))
    report = summarize(results, duration, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if report["completed"] else 1)


if __name__ == "__main__":
    main()
