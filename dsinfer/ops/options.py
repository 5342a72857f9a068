"""The process-wide kernel options: the ``KernelConfig.PROCESS_WIDE`` fields, which pick a kernel (or its launch
mode) inside every op call, too deep in the call chain to be passed down.

Taken from the ``DSINFER_*`` variables once, when this module is imported, and set again at start-up from the
engine's config by ``configure`` (the model loader calls it before it builds the model). Nothing reads the
environment during a forward. It imports only ``dsinfer.envs``, so ``ops.triton`` may read it without closing an
import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from dsinfer import envs


@dataclass(frozen=True)
class KernelOptions:
    use_triton: str  # auto (on CUDA) | always | never (``ops.dispatch.use_triton``)
    triton_gemv: bool  # small linear layers may take their tuned Triton tile (``ops.linear``)
    pdl: bool  # Triton kernels launch with programmatic dependent launch on sm_90+ (``ops.triton.pdl``)
    pdl_early_trigger: str  # off | all | dense | comma-separated kernel roles (``envs.PDL_EARLY_TRIGGER``)


def _from_envs() -> KernelOptions:
    return KernelOptions(envs.USE_TRITON.get(), envs.TRITON_GEMV.get(), envs.PDL.get(), envs.PDL_EARLY_TRIGGER.get())


_current = _from_envs()  # replaced as a whole, by ``configure`` only


def current() -> KernelOptions:
    return _current


def configure(kernel) -> KernelOptions:
    """Set the options from ``kernel`` (a ``config.KernelConfig``, or anything with these fields) at start-up,
    before a forward; -> the options it replaces (``configure`` takes them back)."""
    global _current
    new = KernelOptions(**{f.name: getattr(kernel, f.name) for f in fields(KernelOptions)})
    if new.use_triton not in ("auto", "always", "never"):
        raise ValueError(f"use_triton must be one of 'auto', 'always', 'never', got {new.use_triton!r}")
    before, _current = _current, new
    return before


def configured(**changes) -> KernelOptions:
    """The current options with ``changes`` (to ``configure``: tests and sweeps)."""
    return replace(_current, **changes)
