"""Reading checkpoint tensors (sharded safetensors) and routing them to parameters via their weight loaders."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (use load_format='dummy' for random ones)")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:  # SafetensorError: an Exception
            raise ValueError(f"cannot read weights file {path}: {exc}") from exc


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, str | int]],
    rename: Callable[[str], str | None],
) -> None:
    """Copy each checkpoint tensor into its parameter; every parameter must be filled exactly once-or-more.

    ``packed_modules`` maps a checkpoint fragment (``q_proj``) to (merged parameter fragment, shard id).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        shard_id = None
        for fragment, (merged, shard) in packed_modules.items():
            if f".{fragment}." in name:
                name, shard_id = name.replace(f".{fragment}.", f".{merged}."), shard
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter ({name!r}) in the model")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameter(s), e.g. {missing[:5]}")


def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Random weights like transformers' init (normal(0, initializer_range)); norms start at one.

    Never near zero: MoE routing over near-zero weights sends every token to the same experts and fakes speed.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        custom = getattr(param, "dummy_init", None)  # e.g. FP8 weights, which normal_ cannot fill
        if custom is not None:
            custom(std, generators.setdefault(param.device, torch.Generator(param.device).manual_seed(seed)))
        elif "norm" in name.rsplit(".", 2)[-2]:
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        elif param.dtype.is_floating_point and param.dtype.itemsize >= 2:
            gen = generators.setdefault(param.device, torch.Generator(param.device).manual_seed(seed))
            param.data.normal_(0.0, std, generator=gen)
