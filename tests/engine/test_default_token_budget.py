"""The step's token budget when none is given: vLLM's defaults by device, GPU memory and usage."""

from types import SimpleNamespace

import pytest
import torch

from dsinfer.engine import arg_utils as config
from dsinfer.engine.arg_utils import EngineArgs, default_batched_tokens


def _gpu_of(monkeypatch, gib: int) -> torch.device:
    props = SimpleNamespace(total_memory=gib << 30)
    monkeypatch.setattr(config.torch.cuda, "get_device_properties", lambda device: props)
    return torch.device("cuda")


@pytest.mark.parametrize("gib, offline, server", [(141, 16384, 8192), (80, 16384, 8192), (40, 8192, 2048)])
def test_cuda_budget_follows_gpu_memory_and_usage(monkeypatch, gib, offline, server):
    device = _gpu_of(monkeypatch, gib)
    assert default_batched_tokens(device, 256) == offline
    assert default_batched_tokens(device, 256, "server") == server


def test_cpu_budget_and_the_max_num_seqs_floor(monkeypatch):
    cpu = torch.device("cpu")
    assert default_batched_tokens(cpu, 256) == default_batched_tokens(cpu, 256, "server") == 2048
    assert default_batched_tokens(cpu, 4096) == 4096
    assert default_batched_tokens(_gpu_of(monkeypatch, 141), 20000, "server") == 20000


def test_unknown_usage_is_rejected():
    with pytest.raises(ValueError, match="usage must be 'offline' or 'server'"):
        default_batched_tokens(torch.device("cpu"), 256, "batch")


def test_engine_config_takes_the_default_unless_given(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu")
    assert args.create_engine_config().scheduler.max_num_batched_tokens == 2048
    assert args.create_engine_config("server").scheduler.max_num_batched_tokens == 2048
    given = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_num_batched_tokens=300)
    assert given.create_engine_config().scheduler.max_num_batched_tokens == 300


def test_the_server_builds_its_engine_with_the_serving_budget(monkeypatch, tiny_llama_dir):
    import argparse

    from dsinfer.server.cli import add_serve_args, build_engine

    usages = []
    monkeypatch.setattr(config, "default_batched_tokens", lambda device, seqs, usage: usages.append(usage) or 512)
    args = add_serve_args(argparse.ArgumentParser()).parse_args([str(tiny_llama_dir), "--device", "cpu"])
    engine = build_engine(args)
    assert usages == ["server"] and engine.config.scheduler.max_num_batched_tokens == 512
