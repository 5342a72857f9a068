"""A serving run's figures from its raw per-request times: vLLM's names (``mean_ttft_ms``, ``p99_itl_ms``, ...),
goodput against SLOs, throughput.

TTFT: request sent to first streamed token. TPOT: (E2E - TTFT) / (output tokens - 1), per request. ITL: the gaps
between streamed chunks, pooled over requests. E2E (``e2el``): request sent to the last chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (90, 99)  # beside the mean and the median
SLO_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys, each in milliseconds


@dataclass
class RequestResult:
    """What one request measured (seconds); ``success`` False keeps its ``error``."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}, "
                             f"got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the threshold must be positive")
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    figures = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return result.success and all(figures[name] * 1000.0 <= limit for name, limit in slos.items())


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds, dtype=float) * 1000.0 if seconds else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    """The figures of one run, then every raw per-request figure (seconds) in request order."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "request_goodput": sum(meets_slos(r, slos) for r in results) / duration if slos else None,
        "goodput_slos_ms": slos,
    }
    summary |= _stats("ttft", [r.ttft for r in ok])
    summary |= _stats("tpot", [r.tpot for r in ok if r.tpot is not None])
    summary |= _stats("itl", [x for r in ok for x in r.itl])
    summary |= _stats("e2el", [r.e2el for r in ok])
    summary |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "e2els": [r.e2el for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    return summary


def format_table(summary: dict) -> str:
    """The human-readable block vLLM prints after a run."""
    lines = [f"{'Successful requests:':<40}{summary['completed']:>12}",
             f"{'Failed requests:':<40}{summary['failed']:>12}",
             f"{'Benchmark duration (s):':<40}{summary['duration']:>12.2f}",
             f"{'Total input tokens:':<40}{summary['total_input_tokens']:>12}",
             f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>12.2f}"]
    if summary["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{summary['request_goodput']:>12.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            label = f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):"
            lines.append(f"{label:<40}{summary[f'{stat}_{name}_ms']:>12.2f}")
    return "\n".join(lines)
