"""Speculative decoding on the engine's side: drafters (``ngram``), the per-position acceptance a drafter's
confidence is calibrated from (``calibration``), and the engine's counters (``metrics``).

Verification is the worker's (``runner.model_runner`` and ``sampling.sampler``): a drafter only proposes.
Imports only ``core`` and ``config``, so the engine (above) and the runner (below it) may both use it.
"""

from __future__ import annotations

from typing import Any


def make_drafter(config: Any) -> Any:
    """The drafter of ``config.speculative`` (an ``EngineConfig``), or None when speculation is off."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method == "ngram":
        from dsinfer.spec_decode.ngram import NgramDrafter

        return NgramDrafter(spec)
    if spec.method == "mtp":
        from dsinfer.spec_decode.mtp import MTPDrafter

        return MTPDrafter()
    raise ValueError(f"speculative_config.method={spec.method!r}: no drafter for it yet")
