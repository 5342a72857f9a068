"""The cut points of a piecewise prefill CUDA graph, as layers mark them (the runner's ``prefill_graphs`` cuts).

A layer wraps the part of its forward that reads the step's attention metadata (the KV-cache store and attention)
in ``attention_piece(fn, inputs, batch)``. Eagerly that is just ``fn(*inputs, batch)``. While a prefill graph is
captured, ``batch.pieces`` holds the capture's ``PieceCutter``: the graph is cut there and ``fn`` runs between two
graphs, on every replay, with the real step's rows and metadata. The layers import this module; the runner
implements ``PieceCutter``; nothing here imports the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dsinfer.core.forward_batch import ForwardBatch


class PieceCutter(Protocol):
    def cut(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            batch: ForwardBatch) -> torch.Tensor:
        """End the graph being captured, record ``fn`` (run on ``inputs`` and ``batch``) as a piece, begin the
        next graph; -> a buffer holding ``fn``'s output, [T, ...]."""


def attention_piece(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                    batch: ForwardBatch) -> torch.Tensor:
    """``fn(*inputs, batch)``: the part of a layer that reads the step's attention metadata. ``inputs`` are
    row-major per token ([T, ...]); so is the result. While a prefill graph is captured (``batch.pieces``), the
    graph is cut here, so ``fn`` must read nothing else that a graph produced: it runs between graphs. A model's
    forward must go through here once per attention layer (the capture checks the count)."""
    if batch.pieces is None:
        return fn(*inputs, batch)
    return batch.pieces.cut(fn, inputs, batch)
