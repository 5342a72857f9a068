"""Runner tests: those marked ``gpu`` need CUDA and are skipped without it; the rest run on CPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _skip_gpu_without_cuda(request):
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
