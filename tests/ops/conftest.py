"""Op tests: each Triton kernel against its torch reference, through the public op.

Every test here runs with the kernel option ``use_triton="always"`` (``DSINFER_USE_TRITON=always`` at start-up).
Without CUDA the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set for each test
(the ops import their kernel modules lazily, so the ``@triton.jit`` decorators see it). Both are put back after
each test, so the rest of the suite is unaffected. Tests marked ``gpu`` are skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# The CPU interpreter truncates float32 -> bf16 instead of rounding, so bf16 gets twice the room there.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2 if HAS_CUDA else 2e-2}


@pytest.fixture(autouse=True)
def _triton_path(monkeypatch, request, kernel_options):
    if request.node.get_closest_marker("gpu") and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    kernel_options(use_triton="always")
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN (floats) or -7 (ints) during the test: unwritten outputs show."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN anywhere gives NaN, which fails every bound)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = _rel_err(out, ref)
    bound = tol if tol is not None else TOLERANCE[dtype]
    assert err < bound, f"relative error {err:.3g} >= {bound:g} ({dtype})"


@pytest.fixture
def assert_close():
    """assert_close(out, ref, dtype, tol=None): relative error under dtype's bound (fp32 1e-4, bf16 1e-2)."""
    return _assert_close
