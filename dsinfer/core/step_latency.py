"""The step-latency curve: seconds one engine step takes against the tokens in its batch.

Piecewise linear over measured points (token count -> seconds): flat below the first point, extended past the
last along the last segment's slope (or proportionally, from a single point). The runner measures the points at
start-up (``runner.warmup.measure_step_latency``: decode batches at token counts spanning the decode range); the
engine then keeps them current from its real steps, each observation moving the nearest point (in log tokens) by
an exponential moving average, after scaling it along the curve's shape to that point's token count. The points
persist under the cache directory (``$DSINFER_CACHE_DIR/step_latency/<fingerprint>.json``; the fingerprint
covers the model's config, dtype, device, block size and kernel choices), so a restart reuses them and skips the
measurement. The curve is plain data: the scheduler reads it (confidence scheduling), nothing here touches a
device.

Where the runner pads a decode step whose sequences have different query lengths to the longest, so that it
replays a CUDA graph (``runner.decode_padding``), the step costs what its sequences x that length cost:
``DecodePadding`` says which steps it pads and prices them (``step_tokens``); other steps cost their tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsinfer import envs
from dsinfer.config import EngineConfig

FORMAT_VERSION = 1


@dataclass(frozen=True)
class DecodePadding:
    """Which steps the runner pads to one query length a sequence (its decode graphs): steps of at most
    ``max_seqs`` sequences, none longer than ``max_query_len`` tokens. The default pads nothing."""

    max_seqs: int = 0  # the largest decode graph's batch (0: no step is padded)
    max_query_len: int = 1  # the longest query a sequence of a padded step may have (1 + k drafts)

    def pads(self, num_seqs: int, longest: int) -> bool:
        """Whether a step of ``num_seqs`` sequences, the longest of ``longest`` tokens, runs padded."""
        return 0 < num_seqs <= self.max_seqs and longest <= self.max_query_len

    def step_tokens(self, query_lens: Sequence[int]) -> int:
        """The tokens a step of these query lengths costs on the curve: sequences x the longest where it runs
        padded, else its tokens."""
        if query_lens and self.pads(len(query_lens), max(query_lens)):
            return len(query_lens) * max(query_lens)
        return sum(query_lens)


class StepLatencyCurve:
    """Step seconds against batch tokens, from measured points, updated by ``observe``."""

    def __init__(self, points: dict[int, float] | None = None, ema: float = 0.1):
        if not 0 < ema <= 1:
            raise ValueError(f"StepLatencyCurve ema must be in (0, 1], got {ema}")
        self.ema = ema
        self._points: dict[int, float] = {}
        for tokens, seconds in (points or {}).items():
            self._set(int(tokens), float(seconds))
        self.num_observed = 0  # real steps folded in since construction

    def _set(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"a step-latency point needs tokens >= 1 and finite seconds > 0, got "
                             f"({tokens}, {seconds})")
        self._points[tokens] = seconds
        self._xs = np.array(sorted(self._points), dtype=np.float64)
        self._ys = np.array([self._points[int(x)] for x in self._xs], dtype=np.float64)

    @property
    def points(self) -> dict[int, float]:
        return dict(sorted(self._points.items()))

    @property
    def ready(self) -> bool:
        """True once the curve has a point (an empty one cannot price a step)."""
        return bool(self._points)

    def __call__(self, tokens: Any) -> Any:
        """Seconds for a step of ``tokens`` (a number or a numpy array of them)."""
        if not self._points:
            raise ValueError("the step-latency curve has no points yet")
        xs, ys = self._xs, self._ys
        t = np.asarray(tokens, dtype=np.float64)
        out = np.interp(t, xs, ys)
        if len(xs) > 1:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            out = np.where(t > xs[-1], ys[-1] + slope * (t - xs[-1]), out)
        else:
            out = np.where(t > xs[-1], ys[-1] * t / xs[-1], out)
        return float(out) if np.ndim(out) == 0 else out

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in a real step of ``tokens`` tokens that took ``seconds``."""
        if tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        self.num_observed += 1
        if not self._points:
            self._set(tokens, seconds)
            return
        nearest = int(self._xs[np.argmin(np.abs(np.log(self._xs) - math.log(tokens)))])
        scaled = seconds * self(nearest) / self(tokens)  # the observation moved along the curve to that point
        self._set(nearest, (1 - self.ema) * self._points[nearest] + self.ema * scaled)

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "points": [[t, s] for t, s in self.points.items()]}

    @classmethod
    def from_json(cls, data: Any, ema: float = 0.1) -> StepLatencyCurve:
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a step-latency curve of format {FORMAT_VERSION}: {str(data)[:80]!r}")
        return cls({int(t): float(s) for t, s in data["points"]}, ema)

    def save(self, path: Path) -> None:
        """Write the points to ``path`` atomically (a reader never sees half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path | None) -> StepLatencyCurve | None:
        """The curve saved at ``path``; None when there is none or it cannot be read (it is measured again)."""
        if path is None or not path.is_file():
            return None
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def fingerprint(config: EngineConfig) -> str:
    """What a step's time depends on: the model's shapes, dtype, device (its name on CUDA), KV block size,
    token budget and kernel choices."""
    device = config.device.device
    name = device.type
    if device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
    key = {"hf_config": config.model.hf_config, "dtype": str(config.model.dtype), "device": name,
           "block_size": config.cache.block_size, "cache_dtype": str(config.cache.cache_dtype),
           "max_num_seqs": config.scheduler.max_num_seqs, "budget": config.scheduler.max_num_batched_tokens,
           "eager": config.device.enforce_eager, "deterministic": config.device.deterministic,
           "kernel": repr(config.kernel)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(config: EngineConfig) -> Path | None:
    """Where this engine's curve is kept: ``<step_latency_dir or $DSINFER_CACHE_DIR/step_latency>/<fp>.json``;
    None when persisting is off (``CacheConfig.step_latency_dir == ""``)."""
    where = config.cache.step_latency_dir
    if where == "":
        return None
    root = Path(where) if where is not None else Path(envs.CACHE_DIR.get()) / "step_latency"
    return root / f"{fingerprint(config)}.json"


def decode_token_counts(max_num_seqs: int, num_speculative_tokens: int, budget: int) -> list[int]:
    """Token counts to measure: powers of two from 1 up to the decode range (every sequence verifying all its
    drafts, within the token budget), and that end itself."""
    top = max(1, min(max_num_seqs * (1 + num_speculative_tokens), budget))
    counts, n = {top}, 1
    while n < top:
        counts.add(n)
        n *= 2
    return sorted(counts)
