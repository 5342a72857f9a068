"""CUDA graphs for decode-only steps: one graph per padded batch size, all captured into one memory pool.

A decode-only step of ``n`` sequences replays the graph of the smallest captured size ``>= n``; larger steps run
eagerly. A graph covers the model forward and the logits of every row; sampling stays outside (the Triton
sampler needs no host sync either). Its inputs are persistent device buffers sized for the largest graph, filled
each step from one non-blocking copy of the packed host arrays (``to_device_packed``). Padding rows get slot -1
(nothing stored), seq_len 0 and an empty query (``query_start_loc`` repeats ``n``), so attention skips them;
their logits are never read.

Attention in a graph reads nothing on the host: ``max_query_len`` is 1 and ``max_seq_len`` is a fixed bound
(``max_model_len``), which fixes the decode kernel's split count per graph.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.runner.input_batch import HostInputs, to_device_packed

logger = logging.getLogger("dsinfer")

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, max_seq_len: int,
                 device: torch.device, sizes: tuple[int, ...] = CAPTURE_SIZES):
        self.model = model
        self.sizes = [s for s in sizes if s <= max_num_seqs] or [max_num_seqs]
        self.max_seq_len = max_seq_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # graph outputs, [size, vocab] in the model dtype

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode step of num_seqs runs at; None: run it eagerly."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) and self.sizes[i] in self.graphs else None

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            logits_indices=self.positions[:0], max_query_len=1, max_seq_len=self.max_seq_len,
            graphed=True,  # captured, or the warm-up before a capture: the graphs' paths (layers.streams)
        )

    def _forward(self, size: int) -> torch.Tensor:
        batch = self._batch(size)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden, upcast=False)  # the sampler upcasts when it must

    @torch.inference_mode()
    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Capture every size, largest first, into ``pool`` on ``stream`` (smaller graphs reuse the largest one's
        memory)."""
        started = time.perf_counter()
        # all-padding inputs: nothing is stored, attention skips every row
        self.slot_mapping.fill_(-1)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        try:
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: compiles kernels and sets up cuBLAS outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self._forward(size)
                self.graphs[size] = graph
        except Exception as exc:  # a model whose forward syncs or allocates on the host: run it eagerly
            logger.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(exc).__name__, exc)
            self.graphs.clear()
            self.logits.clear()
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.sizes,
                    time.perf_counter() - started)

    def load_inputs(self, host: HostInputs, size: int) -> None:
        """Copy one decode step's host arrays into the graph's buffers (padding rows reset)."""
        n = len(host.seq_lens)
        pad = size - n
        ids, positions, slots, seq_lens, qsl, tables = to_device_packed(
            [np.pad(host.input_ids, (0, pad)), np.pad(host.positions, (0, pad)),
             np.pad(host.slot_mapping, (0, pad), constant_values=-1), np.pad(host.seq_lens, (0, pad)),
             np.pad(host.query_start_loc, (0, pad), mode="edge"), host.block_tables], self.input_ids.device)
        self.input_ids[:size].copy_(ids)
        self.positions[:size].copy_(positions)
        self.slot_mapping[:size].copy_(slots)
        self.seq_lens[:size].copy_(seq_lens)
        self.query_start_loc[:size + 1].copy_(qsl)
        self.block_tables[:n, :tables.shape[1]].copy_(tables)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on the loaded inputs; returns its logits buffer [size, vocab]."""
        self.graphs[size].replay()
        return self.logits[size]
