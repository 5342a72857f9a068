"""CUDA graphs for steps with prompt tokens (prefill, chunked prefill with decode rows riding along), cut at
attention ("piecewise").

Why: an eager step of a model with many small kernels is bound by the host. DeepSeek-V2-Lite spent 37.7 ms of
wall time on a 1024-token prefill step that holds 19 ms of kernels, about 540 launches from Python (H200,
docs/benchmarks.md, session 7). One graph per step size cannot serve such steps as the decode graphs do: the
attention kernels' grids and metadata (how many sequences, their lengths, which rows are decode rows) change
from step to step, while everything else in a layer is row-wise and only depends on the token count.

So the forward is captured per padded token count, with the attention of every layer left out. Layers mark the
cut with ``layers.graph_pieces.attention_piece(fn, inputs, batch)`` around the part that reads the step's attention
metadata (the KV-cache store and attention). Eagerly that is just ``fn(*inputs, batch)``. While a graph is captured
(the batch carries a ``_Recorder`` as ``batch.pieces``), the capture ends there: the inputs are copied (inside
the graph) into static buffers, ``fn`` is recorded, its output gets a static buffer that the next graph reads, and
a new graph begins. A replay runs graph 0, then piece 0 eagerly on the real step's rows and metadata, graph 1,
piece 1, ... and the last graph.

The static buffers are shared by every layer and every token count: one stream orders a piece's read of its
inputs before the next graph's copy overwrites them. Padding rows (past the step's tokens) are token 0 at
position 0 with a zero attention output in every layer (their rows of the buffers are zeroed each step, so no
stale value, NaN or not, lingers there); they are never read, and pieces see only the real rows.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.runner.warmup import SEQUENCE_TOKENS, dummy_prefill_batch

logger = logging.getLogger("dsinfer")


def capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture, up to ``max_tokens``: powers of two to 256, then steps of 1.5x and 4/3x (384, 512,
    768, 1024, 1536, 2048, ...), so that a step is padded by at most half of its size (a 257-token step runs at
    384). The engine's default limit is 2,048 (``max_prefill_graph_tokens``)."""
    sizes, size = [], 16
    while size <= max_tokens:
        sizes.append(size)
        if size < 256:
            size *= 2
        else:  # 2^k -> 1.5 x 2^k -> 2^(k+1)
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return sizes


@dataclass
class _Piece:
    fn: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]  # static buffers, [max tokens, ...]
    output: torch.Tensor  # static buffer, [max tokens, ...]


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # one more than pieces
    pieces: list[_Piece] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # the last graph's output, [size, hidden]

    @functools.cached_property
    def outputs(self) -> list[torch.Tensor]:
        """The distinct static buffers the pieces write (usually one, shared by every layer)."""
        return list({id(piece.output): piece.output for piece in self.pieces}.values())


class _Recorder:
    """Cuts one forward at its attention pieces (a ``layers.graph_pieces.PieceCutter``). ``capture=False`` (the
    warm-up forward before a capture) runs everything eagerly but through the static buffers, which it allocates;
    ``capture=True`` records graphs."""

    def __init__(self, buffers: dict, rows: int, capture: bool, pool=None):
        self.buffers, self.rows, self.capture, self.pool = buffers, rows, capture, pool
        self.result = _Captured()

    def begin(self) -> None:
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            self.result.graphs.append(graph)
            graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        if self.capture:
            self.result.graphs[-1].capture_end()

    def _buffer(self, role: tuple, like: torch.Tensor) -> torch.Tensor:
        key = (role, tuple(like.shape[1:]), like.dtype)
        buf = self.buffers.get(key)
        if buf is None:
            if self.capture:  # an allocation here would come from the graph's pool and be recorded
                raise RuntimeError(f"no static buffer for {key}: the warm-up forward took another path")
            buf = self.buffers[key] = torch.zeros((self.rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
        return buf

    def cut(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            batch: ForwardBatch) -> torch.Tensor:
        n = inputs[0].shape[0]
        static = [self._buffer(("in", i), x) for i, x in enumerate(inputs)]
        for buf, x in zip(static, inputs):
            buf[:n].copy_(x)
        self.end()
        # eagerly, between two captures: the output's shape sizes its buffer (what it computes is discarded)
        out = fn(*(buf[:n] for buf in static), batch)
        output = self._buffer(("out",), out)
        output[:n].copy_(out)
        self.result.pieces.append(_Piece(fn, static, output))
        self.begin()
        return output[:n]


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    fn()  # first use: lazily built state
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


class PrefillGraphs:
    """Piecewise graphs of the model forward at the token counts ``capture_sizes(max_tokens)``."""

    def __init__(self, model: nn.Module, max_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_tokens)
        self.max_model_len, self.block_size, self.device = max_model_len, block_size, device
        rows = self.sizes[-1] if self.sizes else 0
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self._buffers: dict = {}
        self._captured: dict[int, _Captured] = {}

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._captured)

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured token count a step of num_tokens runs at; None: run it eagerly."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) and self.sizes[i] in self._captured else None

    def _batch(self, size: int) -> ForwardBatch:
        """Prompts of ``size`` tokens in all (stored nowhere): shapes the pieces' outputs during the capture."""
        return dummy_prefill_batch(size, min(SEQUENCE_TOKENS, self.max_model_len), self.block_size, self.device)

    def _forward(self, size: int, recorder: _Recorder) -> torch.Tensor:
        """The forward cut by ``recorder``: a capture, or the warm-up before it (both take the graphs' paths)."""
        batch = self._batch(size)  # host-to-device copies: not inside a capture
        batch.graphed, batch.pieces = True, recorder
        recorder.begin()
        try:
            hidden = self.model(self.input_ids[:size], self.positions[:size], batch)
        finally:
            recorder.end()
        pieces, layers = len(recorder.result.pieces), len(self.model.attention_layers())
        if pieces != layers:  # an attention layer that bypassed attention_piece would be frozen into a graph
            raise RuntimeError(f"the forward was cut {pieces} times for {layers} attention layers")
        return hidden

    @torch.inference_mode()
    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Capture every size, largest first, into ``pool`` on ``stream`` (the decode graphs' pool and stream:
        the allocator reuses a pool's free memory on the stream it was freed on; one graph runs at a time)."""
        if not self.sizes:
            return
        started = time.perf_counter()
        rows = self.sizes[-1]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for size in reversed(self.sizes):
                    # warm-up: compiles this size's kernels, sets up cuBLAS and allocates the static buffers
                    self._forward(size, _Recorder(self._buffers, rows, capture=False))
                    torch.cuda.synchronize(self.device)
                    recorder = _Recorder(self._buffers, rows, capture=True, pool=pool)
                    recorder.result.hidden = self._forward(size, recorder)
                    self._captured[size] = recorder.result
                self._drop_slower_than_eager()
        except Exception as exc:  # e.g. a forward that syncs on the host outside attention: eager steps
            logger.warning("prefill CUDA graphs failed (%s: %s); prompt steps run eagerly", type(exc).__name__, exc)
            self._captured.clear()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        if not self._captured:
            self._buffers.clear()
        logger.info("prefill CUDA graphs for %s tokens (captured %s) in %.1f s", self.captured_sizes, self.sizes,
                    time.perf_counter() - started)

    def _drop_slower_than_eager(self) -> None:
        """Keep the sizes below the first one whose graphs are not faster than the eager forward of the smallest
        step they would serve (one token more than the size below). Graphs win where the host is the bottleneck;
        past that their copies and the padding cost (Llama-3.1-8B, 1,024 tokens, H200: 26.2 ms against 24.3 ms
        eager; DeepSeek-V2-Lite: 17.3 ms against 31.7 ms), and where that crossing lies depends on the model and
        the machine, so it is measured here, on dummy prompts."""
        smaller = 0
        for size in self.captured_sizes:
            graphs = _best_seconds(functools.partial(self.run, size, self._batch(size)), self.device)
            n = smaller + 1 if smaller else size
            eager = _best_seconds(functools.partial(self.model, self.input_ids[:n], self.positions[:n], self._batch(n)),
                                  self.device)
            if graphs >= eager:
                for dropped in [s for s in self._captured if s >= size]:
                    del self._captured[dropped]
                logger.info("prefill CUDA graphs stop below %d tokens: %.2f ms there against %.2f ms for %d tokens "
                            "eager", size, graphs * 1e3, eager * 1e3, n)
                return
            smaller = size

    @torch.inference_mode()  # the static buffers are inference tensors (made during the capture)
    def run(self, size: int, batch: ForwardBatch) -> torch.Tensor:
        """The forward of ``batch`` (at most ``size`` tokens) through the graphs of ``size``: hidden [T, D]."""
        captured = self._captured[size]
        n = batch.num_tokens
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        if n < size:
            for buf in (self.input_ids, self.positions, *captured.outputs):
                buf[n:size].zero_()
        for graph, piece in zip(captured.graphs, captured.pieces):
            graph.replay()
            piece.output[:n].copy_(piece.fn(*(buf[:n] for buf in piece.inputs), batch))
        captured.graphs[-1].replay()
        return captured.hidden[:n]
