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
    the loop ends. An existing freeze (another loop's, or the process's own) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
