"""``dsinfer bench serve``: streaming requests to an OpenAI-compatible server at a request rate (Poisson, or gamma
with ``burstiness``, as vLLM) or at a fixed concurrency, timed per chunk on the client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

from dsinfer.bench.datasets import BenchRequest
from dsinfer.bench.metrics import RequestResult, summarize


@dataclass(frozen=True)
class ServeConfig:
    """One run's settings (recorded in its result JSON)."""

    base_url: str  # server root, without /v1
    model: str
    request_rate: float = float("inf")  # requests per second; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the gaps between arrivals: 1 is Poisson, lower is burstier
    max_concurrency: int | None = None  # cap on requests in flight
    seed: int = 0  # arrival times and random prompts
    api_key: str | None = None
    timeout: float = 600.0  # seconds per request
    ignore_eos: bool = True  # every request generates its output_len tokens
    temperature: float = 0.0
    progress: bool = True  # a tqdm bar over finished requests


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds to wait after each request before the next: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    whose mean is 1/rate whatever the burstiness (vLLM's); zeros at an infinite rate."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive (inf: all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if rate == float("inf"):
        return np.zeros(count)
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=count)


def _body(cfg: ServeConfig, req: BenchRequest) -> tuple[str, dict]:
    body = {"model": cfg.model, "max_tokens": req.output_len, "stream": True, "temperature": cfg.temperature,
            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if req.messages is not None:
        return "/v1/chat/completions", body | {"messages": req.messages}
    return "/v1/completions", body | {"prompt": req.prompt}


def _chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send_one(client: httpx.AsyncClient, cfg: ServeConfig, req: BenchRequest) -> RequestResult:
    """One streamed request; a chunk with new text counts as a token arrival (its gap is an ITL)."""
    path, body = _body(cfg, req)
    res = RequestResult(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    pieces, num_chunks = [], 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return res
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices") or not (text := _chunk_text(chunk)):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, num_chunks = now, num_chunks + 1
                pieces.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        res.error = repr(exc)
        return res
    res.e2el = last - start
    res.generated_text = "".join(pieces)
    res.output_len = res.output_len or num_chunks
    res.success = num_chunks > 0
    if not res.success:
        res.error = "the stream carried no token"
    return res


async def run_requests(cfg: ServeConfig, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival schedule; the results in request order and the run's duration."""
    from tqdm.asyncio import tqdm

    gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    bar = tqdm(total=len(requests), disable=not cfg.progress, desc="requests")
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.timeout,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:

        async def limited(req: BenchRequest) -> RequestResult:
            async with limit:
                result = await send_one(client, cfg, req)
            bar.update(1)
            return result

        tasks, start = [], time.perf_counter()
        for req, gap in zip(requests, gaps):
            tasks.append(asyncio.create_task(limited(req)))
            if gap > 0:
                await asyncio.sleep(float(gap))
        results = await asyncio.gather(*tasks)
    bar.close()
    return list(results), time.perf_counter() - start


def first_model(base_url: str, api_key: str | None) -> str:
    """The id of the first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def benchmark(cfg: ServeConfig, requests: list[BenchRequest], slos: dict[str, float], label: str = "",
              num_gpus: int = 1, dataset: str = "random") -> dict:
    """Run the requests and return the result: settings, figures, then every raw per-request figure."""
    results, duration = asyncio.run(run_requests(cfg, requests))
    settings = {k: (str(v) if v == float("inf") else v) for k, v in asdict(cfg).items() if k != "api_key"}
    head = {"date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"), "label": label or cfg.model,
            "num_gpus": num_gpus, "dataset_name": dataset, "num_prompts": len(requests), **settings}
    return head | summarize(results, duration, slos)


def save_result(result: dict, result_dir: str | Path, filename: str | None = None) -> Path:
    """Write the result JSON under ``result_dir`` (made if missing); the default name says label, rate and
    concurrency."""
    directory = Path(result_dir)
    directory.mkdir(parents=True, exist_ok=True)
    if filename is None:
        label = re.sub(r"[^A-Za-z0-9._-]+", "_", str(result["label"]))
        filename = f"{label}-{result['request_rate']}qps-c{result['max_concurrency'] or 'inf'}.json"
    path = directory / filename
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
