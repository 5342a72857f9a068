"""Grain keys and the model fingerprint.

A grain is ``grain`` tokens (a multiple of the KV block size); its key is the prefix cache's chained hash of the
grain's last block (which covers every token before it) mixed with the model fingerprint, so two engines of the
same model, weights and KV layout compute the same keys for the same tokens and no other engine does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dsinfer.config import EngineConfig

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_SAMPLE_BYTES = 1 << 16  # of each weight file, from its start and from its end


def grain_keys(block_hashes: list[bytes], blocks_per_grain: int, fingerprint: bytes, start: int = 0) -> list[bytes]:
    """Keys of the full grains ``start, start + 1, ...`` that ``block_hashes`` (a request's chain) covers."""
    keys = []
    for g in range(start, len(block_hashes) // blocks_per_grain):
        h = hashlib.blake2b(fingerprint, digest_size=16)
        h.update(block_hashes[(g + 1) * blocks_per_grain - 1])
        keys.append(h.digest())
    return keys


def model_fingerprint(model_dir: Path, hf_config: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """16 bytes naming the model (its config), its weights (each weight file's name, size and first and last
    64 KiB, so two random checkpoints of one config differ) and ``extra`` (what shapes the stored KV: dtypes,
    block size, an MTP layer's cache, the load format and seed of dummy weights)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(hf_config, sort_keys=True, default=str).encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES) if model_dir.is_dir() else []
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(max(size - _SAMPLE_BYTES, 0))
            h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


def engine_fingerprint(config: EngineConfig) -> bytes:
    """The fingerprint of an engine's stored KV: its model and weights, and what shapes the cache's bytes."""
    spec = config.speculative
    extra = {"dtype": str(config.model.dtype), "cache_dtype": str(config.cache.cache_dtype),
             "block_size": config.cache.block_size, "mtp": spec.enabled and spec.method == "mtp",
             "load_format": config.load.load_format,
             "seed": config.load.seed if config.load.load_format == "dummy" else None}
    return model_fingerprint(config.model.path, config.model.hf_config, extra)
