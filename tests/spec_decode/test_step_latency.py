"""The step-latency curve: piecewise linear over its points, moved by real steps, saved and reloaded by fingerprint;
the runner measures it at start-up and the engine reuses the saved one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsinfer import LLM
from dsinfer.core import step_latency
from dsinfer.core.step_latency import StepLatencyCurve, decode_token_counts


def test_curve_interpolates_between_points_and_extends_the_last_slope():
    curve = StepLatencyCurve({1: 1.0, 4: 2.5, 8: 4.5})
    assert curve(2) == pytest.approx(1.5)
    assert curve(6) == pytest.approx(3.5)
    assert curve(0.5) == pytest.approx(1.0)  # flat below the first point
    assert curve(12) == pytest.approx(6.5)  # past the last: the last segment's slope (0.5 a token)
    assert curve(np.array([1, 8, 10])).tolist() == pytest.approx([1.0, 4.5, 5.5])
    assert StepLatencyCurve({4: 2.0})(8) == pytest.approx(4.0)  # one point: proportional beyond it


def test_an_observation_moves_the_nearest_point_along_the_curve_shape():
    curve = StepLatencyCurve({1: 1.0, 16: 2.0}, ema=0.5)
    curve.observe(14, curve(14) * 3)  # three times the curve, near 16: point 16 moves halfway to 6.0
    assert curve.points == {1: 1.0, 16: pytest.approx(4.0)}
    curve.observe(1, 3.0)
    assert curve.points[1] == pytest.approx(2.0)
    assert curve.num_observed == 2
    empty = StepLatencyCurve()
    assert not empty.ready
    empty.observe(8, 0.25)
    assert empty.points == {8: 0.25}


def test_bad_points_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"\(0, 1.0\)"):
        StepLatencyCurve({0: 1.0})
    with pytest.raises(ValueError, match="no points"):
        StepLatencyCurve()(4)


def test_saved_curve_loads_back_and_a_corrupt_file_reads_as_none(tmp_path):
    path = tmp_path / "a" / "curve.json"
    StepLatencyCurve({1: 0.5, 32: 0.75}).save(path)
    assert StepLatencyCurve.load(path).points == {1: 0.5, 32: 0.75}
    path.write_text("{not json")
    assert StepLatencyCurve.load(path) is None
    path.write_text(json.dumps({"version": 99, "points": []}))
    assert StepLatencyCurve.load(path) is None
    assert StepLatencyCurve.load(tmp_path / "missing.json") is None


def test_measured_counts_span_the_decode_range_within_the_budget():
    assert decode_token_counts(8, 3, 2048) == [1, 2, 4, 8, 16, 32]
    assert decode_token_counts(256, 3, 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert decode_token_counts(1, 0, 64) == [1]


SPEC = {"method": "ngram", "num_speculative_tokens": 2, "confidence_scheduling": True}


def test_the_runner_measures_the_curve_once_and_a_restart_reuses_it(tiny_llama_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), max_num_seqs=4, num_kv_blocks=64, step_latency_dir=str(tmp_path),
              speculative_config=SPEC)
    engine = llm.engine
    points = engine.step_latency.points
    assert sorted(points) == [1, 2, 4, 8, 12] and all(s > 0 for s in points.values())
    path = step_latency.cache_path(engine.config)
    assert path.parent == tmp_path and StepLatencyCurve.load(path).points == points
    StepLatencyCurve({1: 7.0, 12: 9.0}).save(path)  # a restart takes the saved curve, measures nothing
    again = LLM(str(tiny_llama_dir), max_num_seqs=4, num_kv_blocks=64, step_latency_dir=str(tmp_path),
                speculative_config=SPEC)
    assert again.engine.step_latency.points == {1: 7.0, 12: 9.0}
    again.generate([{"prompt_token_ids": [5, 6, 5, 6, 5]}], use_tqdm=False)
    assert again.engine.step_latency.num_observed > 0
    again.engine.shutdown()  # saves what the real steps taught it (CPU steps: far below 7 s)
    assert StepLatencyCurve.load(path).points[1] < 7.0


def test_the_fingerprint_follows_what_step_time_depends_on(tiny_llama_dir, tmp_path):
    def path(**kwargs):
        return step_latency.cache_path(LLM(str(tiny_llama_dir), num_kv_blocks=16, step_latency_dir=str(tmp_path),
                                           **kwargs).engine.config)

    assert path() == path()
    assert path(max_num_seqs=3) != path() and path(dtype="bfloat16") != path()
    assert step_latency.cache_path(LLM(str(tiny_llama_dir), num_kv_blocks=16, step_latency_dir="")
                                   .engine.config) is None


def test_a_failed_measurement_leaves_the_curve_to_the_real_steps(tiny_llama_dir, tmp_path, monkeypatch):
    from dsinfer.runner import model_runner

    def fail(*args, **kwargs):
        raise RuntimeError("no dummy batches here")

    monkeypatch.setattr(model_runner, "measure_step_latency", fail)
    llm = LLM(str(tiny_llama_dir), max_num_seqs=4, num_kv_blocks=64, step_latency_dir=str(tmp_path),
              speculative_config=SPEC)
    assert not llm.engine.step_latency.ready
    llm.generate([{"prompt_token_ids": [5, 6, 5, 6, 5]}], use_tqdm=False)
    assert llm.engine.step_latency.ready
