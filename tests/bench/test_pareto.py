"""The Pareto frontier of serving results, and ``dsinfer bench plot`` drawing a PNG from result JSONs."""

from __future__ import annotations

import json

import pytest

from dsinfer.bench.pareto import Point, pareto_frontier, point_of
from dsinfer.bench.sweep import parse_grid, sweep_points
from dsinfer.entrypoints.cli import main


def _p(per_user: float, per_gpu: float, label: str = "a") -> Point:
    return Point(label, per_user, per_gpu, "rate 1")


def test_frontier_keeps_only_undominated_points_by_rising_per_user_speed():
    points = [_p(10, 100), _p(20, 80), _p(15, 70), _p(30, 40), _p(5, 90), _p(30, 30, "b")]
    assert pareto_frontier(points) == [_p(10, 100), _p(20, 80), _p(30, 40)]


def test_frontier_drops_a_point_tied_on_one_axis_and_worse_on_the_other():
    assert pareto_frontier([_p(10, 50), _p(10, 60), _p(5, 60)]) == [_p(10, 60)]


def test_point_of_a_result_divides_throughput_by_gpus_and_inverts_tpot():
    result = {"label": "dsinfer", "median_tpot_ms": 20.0, "output_throughput": 800.0, "num_gpus": 2,
              "completed": 4, "max_concurrency": 8, "request_rate": "inf"}
    assert point_of(result) == Point("dsinfer", 50.0, 400.0, "conc 8", 8.0)
    assert point_of(result | {"max_concurrency": None, "request_rate": 2.5}).knob_value == 2.5
    assert point_of(result | {"median_tpot_ms": 0.0}) is None


def test_sweep_grid_takes_rates_or_concurrencies_not_both():
    assert sweep_points(parse_grid("1,2.5,inf", float, "--request-rates"), None) == [
        (1.0, None), (2.5, None), (float("inf"), None)]
    assert sweep_points(None, [4, 16]) == [(float("inf"), 4), (float("inf"), 16)]
    with pytest.raises(ValueError, match="exactly one of"):
        sweep_points([1.0], [4])
    with pytest.raises(ValueError, match="positive"):
        parse_grid("0,2", int, "--concurrencies")


def test_plot_writes_a_png_from_result_jsons(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for label, shift in (("dsinfer", 1.0), ("vllm", 0.8)):
        for conc, tpot, tput in ((1, 10.0, 100.0), (4, 14.0, 300.0), (16, 25.0, 600.0)):
            result = {"label": label, "median_tpot_ms": tpot, "output_throughput": tput * shift, "num_gpus": 1,
                      "completed": 10, "max_concurrency": conc, "request_rate": "inf"}
            (tmp_path / f"{label}-{conc}.json").write_text(json.dumps(result))
    out = tmp_path / "plots" / "pareto.png"
    assert main(["bench", "plot", str(tmp_path), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    frontier = [line for line in capsys.readouterr().out.splitlines() if line.startswith("frontier:")]
    assert frontier == [f"frontier: dsinfer conc {c}: {u:.1f} tok/s/user, {g:.1f} tok/s/GPU"
                        for c, u, g in ((16, 40.0, 600.0), (4, 1000 / 14, 300.0), (1, 100.0, 100.0))]
