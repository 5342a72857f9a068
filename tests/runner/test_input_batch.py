"""Host step inputs to the device: several arrays in one packed copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsinfer.runner.input_batch import to_device_packed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_arrays_come_back_with_their_dtypes_shapes_and_values(device):
    rng = np.random.default_rng(0)
    arrays = [np.arange(7, dtype=np.int64), rng.integers(0, 99, (3, 5), dtype=np.int32),  # 60 bytes: unaligned end
              rng.random(3, dtype=np.float32), np.zeros(0, np.int64), np.array([True, False, True]),
              rng.integers(-9, 9, (2, 3), dtype=np.int64)[:, ::2]]  # a strided view
    out = to_device_packed(arrays, torch.device(device))
    assert len(out) == len(arrays)
    for a, t in zip(arrays, out):
        assert t.device.type == device and tuple(t.shape) == a.shape
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        assert np.array_equal(t.cpu().numpy(), a)
        if device == "cuda":
            assert t.data_ptr() % 16 == 0  # every array aligned for any element type
