"""``benchmarks/decode_env_sweep.py`` refuses what it cannot sweep before loading a model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_env_sweep import parse_args  # noqa: E402


def test_a_declared_variable_and_its_values_are_taken(monkeypatch):
    monkeypatch.setenv("DSINFER_ROUTER_GEMV", "1")  # restored after the test
    args = parse_args(["--var", "DSINFER_ROUTER_GEMV", "--values", "0", "1", "--batch-sizes", "1", "64"])
    assert args.values == ["0", "1"] and args.batch_sizes == [1, 64] and args.device == "cuda"


def test_an_undeclared_variable_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--var", "DSINFER_NO_SUCH_THING", "--values", "1"])
    assert "not a declared DSINFER_* variable" in capsys.readouterr().err


def test_a_value_that_does_not_parse_is_refused(monkeypatch):
    monkeypatch.setenv("DSINFER_TRITON_GEMV", "1")
    with pytest.raises(ValueError, match="DSINFER_TRITON_GEMV"):
        parse_args(["--var", "DSINFER_TRITON_GEMV", "--values", "1", "maybe"])
