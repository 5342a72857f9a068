"""``dsinfer bench throughput --step-breakdown``: how the steps of an offline run are summed by kind."""

from __future__ import annotations

import pytest

from dsinfer.bench.steps import step_breakdown, summarize_steps


def test_steps_are_summed_by_kind_and_idle_is_apart():
    steps = [(200.0, 0.0, -1), (210.0, 0.5, -1), (20.0, 0.1, 256), (22.0, 0.1, 256), (15.0, 0.2, 100)]
    rows = {kind: (n, sec) for kind, n, sec in summarize_steps(steps)}
    assert rows["steps with prompt tokens"] == (2, pytest.approx(0.410))
    assert rows["decode steps, B=256"] == (2, pytest.approx(0.042))
    assert rows["decode steps, B<256"] == (1, pytest.approx(0.015))
    assert rows["GPU idle between steps"] == (5, pytest.approx(0.0009))
    assert sum(n for kind, (n, _) in rows.items() if kind != "GPU idle between steps") == len(steps)


def test_no_steps_give_only_the_idle_row():
    assert summarize_steps([]) == [("GPU idle between steps", 0, 0.0)]


class _Event:
    """A CUDA event's timing surface: a time stamp in ms."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, later: _Event) -> float:
        return later.ms - self.ms


def test_breakdown_reads_the_runners_events_as_gpu_time_and_gaps():
    class Runner:  # (start, done, decode batch or -1), as ModelRunner.launch records them
        step_events = [(_Event(0.0), _Event(100.0), -1), (_Event(101.0), _Event(121.0), 8),
                       (_Event(121.5), _Event(141.5), 8)]

    rows = {kind: (n, sec) for kind, n, sec in step_breakdown(Runner())}
    assert rows["steps with prompt tokens"] == (1, pytest.approx(0.1))
    assert rows["decode steps, B=8"] == (2, pytest.approx(0.04))
    assert rows["GPU idle between steps"] == (3, pytest.approx(0.0015))
