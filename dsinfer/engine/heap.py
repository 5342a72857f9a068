"""The garbage collector beside a step loop.

CPython's full collection walks every tracked object, and a serving process holds hundreds of thousands of them
from its start (modules, the model's parameters and their wrappers, Triton's and torch's caches, the prompts): the
dev machine measured one such walk at 158 ms, every ~20 steps at B=256 (the steps' short-lived plans and outputs
pile up in the oldest generation and trigger it), about 3 ms a step on average and a GPU stall each time it runs.
A loop therefore runs with what existed at its start frozen (``gc.freeze``): collections walk only what the loop
made since.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Run a step loop with the objects alive at its start out of the collector's walks, and give them back to
    it after. No collection first (it would cost a full walk per call): garbage already there waits, frozen, until
    the loop ends.

    The freeze is taken whatever was frozen before: a few hundred objects frozen by someone else at start-up (the
    H200 machine's processes hold 375 before the first loop) must not leave the ~200k of the model and its caches
    in the walks (a 70-80 ms full collection inside the decode loop, 4% of the GPU's time idle at B=256, session
    28). Only the outermost freezer unfreezes: what was frozen before this loop stays frozen after it, and with it
    what this loop froze."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()
