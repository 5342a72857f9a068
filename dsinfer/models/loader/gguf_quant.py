"""A GGUF file's linears as CPU quantized packs (``ops.cpu_quant`` formats), written once beside the conversion.

``cached_gguf_quantized(gguf, converted_dir, mode)`` writes ``quantized/<mode>-v1.safetensors`` into the converted
directory on first use: every linear weight (and the token embedding) as ``<name>.qweight`` / ``.scales`` /
``.mins``, every other tensor (norms, biases) in float32. ``iterate_quantized`` reads it back, yielding a
``QuantizedWeight`` under each weight's HF name.

The GGUF blocks are taken as they are where the layout allows, never through float32:
- Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m) are int4 as stored (d, m float16; the same nibble order);
- Q4_K's 32-element sub-blocks are int4 with d = d * sc and m = -dmin * mn (rounded to float16) and their nibbles
  reordered into the Q4_0 order;
- Q8_0 is int8 as stored.
Anything else (Q6_K, Q5_*, F16, F32, ...) is dequantized by gguf-py and quantized once (``cpu_quant.quantize``).
Modes: "gguf" keeps each tensor's own width (int4 for the 4-bit types, int8 for the rest); "int8" makes every
linear int8; "int4" every linear int4 except the token embedding / LM head, which stay int8 (as llama.cpp keeps
its output tensor wider: the logits are the most sensitive product).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import ReaderTensor
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file

from dsinfer.models.loader.gguf import _ARCHS, _hf_tensor_name, _open_reader, _unpermute_rope_rows
from dsinfer.ops.cpu_quant import BLOCK, QuantizedWeight, pack_int4, quantize

logger = logging.getLogger(__name__)

VERSION = 1
_QUANTIZED_KINDS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
_WIDE = {"token_embd", "output"}  # int8 in "int4" mode
_PARTS = ("qweight", "scales", "mins")


def cached_gguf_quantized(gguf_path: Path, converted_dir: Path, mode: str, hf_config: dict[str, Any]) -> Path:
    """The quantized checkpoint of ``gguf_path`` in ``mode``, written on first use (atomically) into
    ``converted_dir`` (its ``cached_gguf_dir``)."""
    final = converted_dir / "quantized" / f"{mode}-v{VERSION}.safetensors"  # not a *.safetensors of the dir
    final.parent.mkdir(exist_ok=True)
    if final.is_file():
        return final
    start = time.perf_counter()
    tensors = dict(_quantized_tensors(gguf_path, mode, hf_config))
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt", "dsinfer_quantization": mode})
        os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("wrote the %s packs of %s to %s in %.1f s", mode, gguf_path, final, time.perf_counter() - start)
    return final


def iterate_quantized(path: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor or ``QuantizedWeight``) for every tensor of a ``cached_gguf_quantized`` file."""
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        packed = {name.rsplit(".", 1)[0] for name in names if name.endswith(".qweight")}
        for name in names:
            base, _, part = name.rpartition(".")
            if base not in packed:
                yield name, f.get_tensor(name)
            elif part == "qweight":
                qweight = f.get_tensor(name)
                mins = f.get_tensor(f"{base}.mins") if f"{base}.mins" in names else None
                fmt = "int4" if qweight.dtype == torch.uint8 else "int8"
                yield f"{base}.weight", QuantizedWeight(fmt, qweight, f.get_tensor(f"{base}.scales"), mins)


def _quantized_tensors(gguf_path: Path, mode: str, hf_config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    reader = _open_reader(gguf_path)
    arch = _ARCHS[hf_config["model_type"]] if hf_config.get("model_type") in _ARCHS else None
    heads = {"attn_q": hf_config["num_attention_heads"],
             "attn_k": hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        if name is None:
            continue
        kind = tensor.name.split(".")[-2]
        permute = heads.get(kind) if arch is not None and arch.rope_permuted else None
        rows = functools.partial(_unpermute_rope_rows, num_heads=permute) if permute else (lambda a: a)
        if name.endswith(".weight") and (kind in _QUANTIZED_KINDS or kind in _WIDE):
            fmt = _target(tensor.tensor_type, kind, mode)
            packs = _pack(tensor, fmt)
            if packs is not None:
                base = name[: -len(".weight")]
                for part, value in zip(_PARTS, packs):
                    if value is not None:
                        yield f"{base}.{part}", torch.from_numpy(np.ascontiguousarray(rows(value)))
                continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape([int(d) for d in reversed(tensor.shape.tolist())])
        yield name, torch.from_numpy(np.ascontiguousarray(rows(values)))


def _target(kind: T, tensor_kind: str, mode: str) -> str:
    four_bit = kind in (T.Q4_0, T.Q4_1, T.Q4_K)
    if mode == "int8" or (mode == "int4" and tensor_kind in _WIDE):
        return "int8"
    if mode == "int4":
        return "int4"
    return "int4" if four_bit else "int8"


def _pack(tensor: ReaderTensor, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(qweight, scales, mins) of a 2-D GGUF tensor in ``fmt``; None where K is not a multiple of 32."""
    rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
    if cols % BLOCK or tensor.data.ndim != 2:
        return None
    kind, raw = tensor.tensor_type, np.asarray(tensor.data)
    if fmt == "int4" and kind in (T.Q4_0, T.Q4_1):
        size = 18 if kind == T.Q4_0 else 20
        blocks = raw.reshape(rows, -1, size)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        m = (-8 * d.astype(np.float32)).astype(np.float16) if kind == T.Q4_0 else \
            blocks[..., 2:4].copy().view(np.float16)[..., 0]
        return blocks[..., size - 16:].reshape(rows, -1), d, m
    if fmt == "int4" and kind == T.Q4_K:
        return _q4_k(raw.reshape(rows, -1, 144))
    if fmt == "int8" and kind == T.Q8_0:
        blocks = raw.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, cols), d, None
    values = dequantize(tensor.data, kind).astype(np.float32).reshape(rows, cols)
    packed = quantize(torch.from_numpy(values), fmt)
    mins = packed.mins.numpy() if packed.mins is not None else None
    return packed.qweight.numpy(), packed.scales.numpy(), mins


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [rows, n, 144] -> int4 packs of their 8 sub-blocks of 32 each."""
    rows, n = blocks.shape[:2]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16].astype(np.uint8)
    # ggml's get_scale_min_k4: 6-bit scale and min of sub-block j
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, n, 4, 32)  # 4 chunks of 64: low nibbles sub-block 2c, high 2c + 1
    values = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n * 8, BLOCK)  # [rows, sub-blocks, 32]
    packed = pack_int4(torch.from_numpy(values.reshape(rows, -1))).numpy()
    scales = (d[..., None] * sc).astype(np.float16).reshape(rows, -1)
    mins = (-dmin[..., None] * mn).astype(np.float16).reshape(rows, -1)
    return packed, scales, mins
