"""Speculative decoding on the engine's side: drafters (``ngram``, ``mtp``, and any registered with
``register_drafter``), the per-position acceptance a drafter's confidence is calibrated from (``calibration``),
and the engine's counters (``metrics``).

Verification is the worker's (``runner.model_runner`` and ``sampling.sampler``): a drafter only proposes.
Imports only ``core`` and ``config``, so the engine (above) and the runner (below it) may both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsinfer.config import SPEC_METHODS, register_spec_method

_FACTORIES: dict[str, Callable[[Any], Any]] = {}  # method name -> factory(EngineConfig) -> a Drafter


def register_drafter(name: str, factory: Callable[[Any], Any]) -> None:
    """Make ``speculative_config={"method": name, ...}`` draft with ``factory(engine_config)`` (a ``Drafter``:
    ``base.Drafter``'s ``propose``, optionally ``observe`` and ``proposes_ahead``). For benchmarks and plug-ins;
    registering a name again replaces its factory, a built-in name is refused."""
    if name in SPEC_METHODS:
        raise ValueError(f"register_drafter: {name!r} is a built-in method ({SPEC_METHODS}); pick another name")
    if not isinstance(name, str) or not name or not callable(factory):
        raise ValueError(f"register_drafter needs a non-empty name and a callable factory, got {name!r}, "
                         f"{factory!r}")
    _FACTORIES[name] = factory
    register_spec_method(name)


def make_drafter(config: Any) -> Any:
    """The drafter of ``config.speculative`` (an ``EngineConfig``), or None when speculation is off."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method in _FACTORIES:
        return _FACTORIES[spec.method](config)
    if spec.method == "ngram":
        from dsinfer.spec_decode.ngram import NgramDrafter

        return NgramDrafter(spec)
    if spec.method == "mtp":
        from dsinfer.spec_decode.mtp import MTPDrafter

        return MTPDrafter(spec.num_speculative_tokens)
    raise ValueError(f"speculative_config.method={spec.method!r}: no drafter for it yet")
