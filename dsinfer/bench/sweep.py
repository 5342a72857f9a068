"""``dsinfer bench sweep``: one serving run per request rate or per concurrency against one URL, a result JSON per
point, then the Pareto PNG of every result in the directory (so sweeps of other configurations, each run with its
own ``--label`` into the same directory, share one plot)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dsinfer.bench.datasets import BenchRequest
from dsinfer.bench.pareto import load_points, plot_pareto
from dsinfer.bench.serve import ServeConfig, benchmark, save_result


def parse_grid(text: str, kind: type, name: str) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]`` of ``kind``; ``inf`` allowed for rates."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} takes comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{name} needs positive values, got {text!r}")
    return values


def sweep_points(rates: list[float] | None, concurrencies: list[int] | None) -> list[tuple[float, int | None]]:
    """(request rate, max concurrency) per point: a rate grid at unbounded concurrency, or a concurrency grid with
    every request sent at once (the concurrency keeps that many in flight)."""
    if bool(rates) == bool(concurrencies):
        raise ValueError("dsinfer bench sweep takes exactly one of --request-rates and --concurrencies")
    if rates:
        return [(rate, None) for rate in rates]
    return [(float("inf"), c) for c in concurrencies]


def run_sweep(base: ServeConfig, requests_for, points: list[tuple[float, int | None]], slos: dict[str, float],
              label: str, num_gpus: int, dataset: str, result_dir: str | Path) -> tuple[list[Path], Path]:
    """Run every point (``requests_for(i)`` gives point i's requests: new prompts for each point, or the prefix
    cache would serve the earlier points' prompts); the JSON paths and the PNG."""
    paths = []
    for i, (rate, concurrency) in enumerate(points):
        cfg = dataclasses.replace(base, request_rate=rate, max_concurrency=concurrency, seed=base.seed + i)
        requests: list[BenchRequest] = requests_for(i)
        result = benchmark(cfg, requests, slos, label, num_gpus, dataset)
        paths.append(save_result(result, result_dir))
        print(f"{label} rate={rate} concurrency={concurrency}: {result['output_throughput']:.1f} out tok/s, "
              f"median TPOT {result['median_tpot_ms']:.2f} ms -> {paths[-1]}")
    png = plot_pareto(load_points([result_dir]), Path(result_dir) / "pareto.png")
    return paths, png
