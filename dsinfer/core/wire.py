"""Plans and outputs to bytes and back, for worker processes: msgpack, never pickle.

Only the contract dataclasses named in ``_TYPES`` and numpy arrays travel as extension types; decoding builds
nothing else (no class lookup by a name the bytes choose beyond that table), so bytes from a worker or a socket
cannot run code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from dsinfer.core.outputs import RunnerOutput, TokenLogprobs
from dsinfer.core.plan import CachedRequestData, KVLoad, KVSave, NewRequestData, RequestSampling, StepPlan

_TYPES = {cls.__name__: cls for cls in (StepPlan, NewRequestData, CachedRequestData, RequestSampling,
                                        RunnerOutput, TokenLogprobs, KVLoad, KVSave)}
_FIELDS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in _TYPES.items()}
_DATACLASS, _NDARRAY = 1, 2


def _default(obj: Any) -> msgpack.ExtType:
    name = type(obj).__name__
    if name in _TYPES and type(obj) is _TYPES[name]:
        values = [getattr(obj, f) for f in _FIELDS[name]]
        return msgpack.ExtType(_DATACLASS, msgpack.packb([name, values], default=_default, use_bin_type=True))
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb([array.dtype.str, list(array.shape), array.tobytes()],
                                                       use_bin_type=True))
    if isinstance(obj, (tuple, frozenset, set)):
        return list(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} to a worker (only core contracts and plain data)")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _DATACLASS:
        name, values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
        cls = _TYPES.get(name)
        if cls is None or len(values) != len(_FIELDS[name]):
            raise ValueError(f"unknown message type {name!r}")
        return cls(**dict(zip(_FIELDS[name], values)))
    if code == _NDARRAY:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise ValueError(f"unknown msgpack extension type {code}")


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
