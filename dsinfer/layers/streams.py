"""A second CUDA stream for work that overlaps the main stream's: DeepSeek's shared experts beside the router and
the routed experts, MLA's rope and latent-cache store beside the query absorption (``KernelConfig.side_stream``).

The model owns one ``SideStream`` (None when the option is off) and hands it to the layers that overlap.
``side.run_beside(fn, x)`` forks: the side stream waits for the main stream's work so far, then runs ``fn(x)``; the
main stream goes on at once. The returned ``join()`` makes the main stream wait for the side stream and gives the
result. Under CUDA graph capture the fork and the join are recorded as graph edges, so a replay runs both branches
concurrently; the side stream joins the capture through its wait, and its allocations come from the graph's pool.
The caller must call ``join`` exactly once, on every path (an unjoined side stream makes the capture fail).

Layers overlap only where ``in_graphs(batch)``: while a CUDA graph is captured, and in the eager forward that warms
a capture up (the capturer sets ``batch.graphed``, so the same kernels and cuBLAS handles get made before the
capture, not inside it). Run eagerly, a fork and a join cost more host time than the overlap saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.core.forward_batch import ForwardBatch


def in_graphs(batch: ForwardBatch) -> bool:
    """Whether this forward is captured into a CUDA graph, or warms up such a capture."""
    return batch.graphed or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class SideStream:
    """The side stream of each CUDA device the model runs on, made on first use (a model may be built before
    its device is current, or on the meta device)."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def run_beside(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start ``fn(x)`` on the side stream of ``x``'s device; -> ``join``: the main stream waits, gets the
        result."""
        main = torch.cuda.current_stream(x.device)
        side = self.stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = fn(x)
        joined = False

        def join() -> torch.Tensor:
            nonlocal joined
            if joined:
                raise RuntimeError("run_beside: join() called twice")
            joined = True
            main.wait_stream(side)
            # made on the side stream, read on the main one: its memory must not go back to the side stream's
            # pool before the main stream's reads are done
            result.record_stream(main)
            return result

        return join
