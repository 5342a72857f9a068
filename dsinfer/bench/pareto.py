"""Pareto plots of serving results: output tokens/s per GPU (the operator's cost) against tokens/s per user
(1000 / median TPOT, the user's speed), one curve per configuration label, the frontier over all of them marked."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    """One serving run on the plot."""

    label: str  # the configuration (engine, settings) the run measured
    per_user: float  # output tokens/s one user sees: 1000 / median TPOT (ms)
    per_gpu: float  # output tokens/s of the whole run / GPUs
    knob: str  # the swept setting of this point ("rate 4" or "conc 8")
    knob_value: float = 0.0  # its number, the order of the points along their curve (inf: all at once)


def point_of(result: dict) -> Point | None:
    """The plot point of one result JSON; None for a run without a TPOT (every request one token, or failed)."""
    tpot = result.get("median_tpot_ms") or 0.0
    if tpot <= 0 or not result.get("completed"):
        return None
    concurrency = result.get("max_concurrency")
    knob = f"conc {concurrency}" if concurrency else f"rate {result.get('request_rate')}"
    value = float(concurrency or result.get("request_rate") or "inf")
    return Point(str(result.get("label", "")), 1000.0 / tpot,
                 result["output_throughput"] / max(int(result.get("num_gpus", 1)), 1), knob, value)


def pareto_frontier(points: list[Point]) -> list[Point]:
    """The points no other point beats on both axes (higher is better on both), by rising per-user speed.

    A point is dominated when another is at least as good on both axes and better on one; of identical points one
    stays."""
    frontier: list[Point] = []
    for p in sorted(points, key=lambda p: (-p.per_user, -p.per_gpu)):
        if not frontier or p.per_gpu > frontier[-1].per_gpu:
            frontier.append(p)
    return frontier[::-1]


def load_points(paths: list[str | Path]) -> list[Point]:
    """The points of result JSON files; a directory stands for every ``*.json`` in it."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no result JSON in {', '.join(map(str, paths))}")
    points = [point_of(json.loads(f.read_text())) for f in files]
    return [p for p in points if p is not None]


def plot_pareto(points: list[Point], output: str | Path, title: str = "") -> Path:
    """Draw the points (one line per label, in the order of the swept setting) and the frontier; write a PNG."""
    if not points:
        raise ValueError("no plottable result: every run lacked a TPOT (one-token outputs or all failed)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label: dict[str, list[Point]] = defaultdict(list)
    for p in points:
        by_label[p.label].append(p)
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    for label, pts in sorted(by_label.items()):
        pts.sort(key=lambda p: p.knob_value)
        ax.plot([p.per_user for p in pts], [p.per_gpu for p in pts], marker="o", label=label)
        for p in pts:
            ax.annotate(p.knob, (p.per_user, p.per_gpu), fontsize=7, textcoords="offset points", xytext=(3, 3))
    front = pareto_frontier(points)
    ax.step([p.per_user for p in front], [p.per_gpu for p in front], where="pre", color="black",
            linestyle="--", linewidth=1, label="Pareto frontier")
    ax.scatter([p.per_user for p in front], [p.per_gpu for p in front], s=90, facecolors="none",
               edgecolors="black", zorder=3)
    ax.set_xlabel("tokens/s per user (1000 / median TPOT ms)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title or "throughput vs interactivity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output
