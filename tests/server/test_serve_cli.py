"""`dsinfer serve`'s engine flags reach EngineArgs (no model is loaded here)."""

from __future__ import annotations

import argparse

import pytest

from dsinfer.server.cli import add_serve_args, engine_args


def _parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_engine_flags_reach_engine_args():
    args = engine_args(_parse("some/model", "--gpu-memory-utilization", "0.5", "--enforce-eager",
                              "--max-prefill-graph-tokens", "512", "--device", "cpu", "--max-num-seqs", "8"))
    assert (args.model, args.gpu_memory_utilization, args.enforce_eager) == ("some/model", 0.5, True)
    assert (args.max_prefill_graph_tokens, args.device, args.max_num_seqs) == (512, "cpu", 8)


def test_flags_not_given_keep_the_engine_defaults():
    from dsinfer.engine.arg_utils import EngineArgs

    assert engine_args(_parse()) == EngineArgs()


def test_a_bad_engine_flag_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        engine_args(_parse("--max-prefill-graph-tokens", "-3"))._validate()


def test_answers_carry_the_requested_served_name():
    from dsinfer.server.context import ServingContext
    from dsinfer.server.settings import ServerSettings

    ctx = ServingContext.__new__(ServingContext)  # only the naming, no engine
    ctx.settings = ServerSettings(served_model_names=("alpha", "beta"))
    assert [ctx.reported_model(n) for n in ("beta", "alpha", None)] == ["beta", "alpha", "alpha"]
    ctx.settings = ServerSettings()
    assert ctx.reported_model("anything") == "default"


def test_exclude_tools_when_tool_choice_none_reaches_the_settings():
    from types import SimpleNamespace

    from dsinfer.server.cli import settings_from_args

    engine = SimpleNamespace(model_config=SimpleNamespace())
    assert not settings_from_args(_parse(), engine).exclude_tools_when_tool_choice_none  # vLLM's default: kept
    settings = settings_from_args(_parse("--exclude-tools-when-tool-choice-none"), engine)
    assert settings.exclude_tools_when_tool_choice_none


def test_a_taken_port_is_refused_before_the_model_loads():
    import socket

    from dsinfer.server.cli import check_address_free, run_serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}"):
            check_address_free("127.0.0.1", port)

        def no_engine(args):
            raise AssertionError("the engine was built although the port is taken")

        with pytest.raises(ValueError, match=f"--port {port}"):
            run_serve(_parse("--port", str(port)), engine_factory=no_engine)
    check_address_free("127.0.0.1", port)  # free again: no error
