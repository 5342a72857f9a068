"""``benchmarks/decode_env_sweep.py`` refuses what it cannot sweep before loading a model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_env_sweep import parse_args, summary_rows  # noqa: E402


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


def test_the_summary_averages_the_repeats_against_the_first_value():
    rows = [("mla", 1, 2.0, 2.1), ("mla", 64, 9.0, 9.1), ("mla,split", 1, 1.9, 2.0), ("mla,split", 64, 9.0, 9.1),
            ("mla", 1, 2.2, 2.3), ("mla,split", 1, 1.9, 2.0)]
    lines = summary_rows(rows)
    assert lines[2:] == [
        "| mla | 1 | 2 | 2.100 | 2.200 | +0.0% | +0.0% |",
        "| mla | 64 | 1 | 9.000 | 9.100 | +0.0% | +0.0% |",
        "| mla,split | 1 | 2 | 1.900 | 2.000 | -9.5% | -9.1% |",
        "| mla,split | 64 | 1 | 9.000 | 9.100 | +0.0% | +0.0% |",
    ]


def test_a_table_entry_takes_gate_up_and_down_overrides():
    from benchmarks.moe_config_sweep import overridden

    entry = {"block_n": 128, "num_stages": 3, "down": {"num_stages": 4}}
    assert overridden(entry, {}) == entry
    assert overridden(entry, {"gate_up": {"num_warps": 8}, "down": {"num_stages": 5}}) == {
        "block_n": 128, "num_stages": 3, "num_warps": 8, "down": {"num_stages": 5}}
    assert "down" not in overridden({"block_n": 64}, {"gate_up": {"split_k": 2}})  # a dense entry stays dense
    with pytest.raises(ValueError, match="'gate_up' and 'down'"):
        overridden(entry, {"gu": {"num_warps": 8}})


def test_an_unknown_table_entry_is_refused_before_loading(capsys):
    from benchmarks.moe_config_sweep import main

    with pytest.raises(SystemExit):
        main(["--key", "1,2,3,bfloat16", "--bucket", "1", "--values", "{}"])
    assert "no bucket '1' under '1,2,3,bfloat16'" in capsys.readouterr().err


def test_a_variable_that_changes_the_weight_layout_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--var", "DSINFER_FUSE_SHARED_EXPERTS", "--values", "0", "1"])
    assert "a run of its own" in capsys.readouterr().err


def test_a_value_is_applied_as_start_up_applies_it(monkeypatch):
    """The engine reads the variables once: the sweep sets the process-wide options and the built layers."""
    from benchmarks.decode_env_sweep import set_value
    from dsinfer.models.llama import LlamaForCausalLM
    from dsinfer.ops import options

    monkeypatch.setenv("DSINFER_PDL_EARLY_TRIGGER", "mla")  # restored after the test
    monkeypatch.setenv("DSINFER_FUSED_SILU_MUL", "1")
    before = options.current()
    model = LlamaForCausalLM(dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                                  vocab_size=32, architectures=["LlamaForCausalLM"]))
    set_value("DSINFER_PDL_EARLY_TRIGGER", "norm,mla")
    assert options.current().pdl_early_trigger == "mla,norm"
    set_value("DSINFER_FUSED_SILU_MUL", "0", model)
    assert [layer.mlp.fused_silu_mul for layer in model.layers] == [False, False]
    options.configure(before)
