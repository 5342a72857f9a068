"""CUDA graphs for decode steps: one graph per (padded batch size, tokens per sequence), all captured into one
memory pool.

A decode step of ``n`` sequences of ``q`` tokens each (1, or 1 + k drafts to verify) replays the graph of the
smallest captured size ``>= n`` for that ``q``; a step whose sequences differ in length is first padded to its
longest (``decode_padding``, models without state slots); larger steps, and the others, run eagerly. A graph
covers the model forward and the logits of every row; sampling stays outside (the Triton sampler needs no host
sync either). Its inputs are persistent device buffers sized for the largest graph, filled
each step from one non-blocking copy of the packed host arrays (``to_device_packed``). Padding rows get slot -1
(nothing stored), seq_len 0 and an empty query (``query_start_loc`` repeats ``n``), so attention skips them;
their logits are never read. A model whose layers keep per-sequence state (DeepSeek-V4's rings, ``StateSlotSpec``)
also gets each sequence's state slot through a buffer (``state_slots``; padding rows -1: they read clamped slots
and write nothing); the slots' state itself lives in the layers' own persistent tensors, which the graph reads and
writes in place.

Attention in a graph reads nothing on the host: ``max_query_len`` is the graph's ``q`` and ``max_seq_len`` is a
fixed bound (``max_model_len``), which fixes the decode kernel's split count per graph.
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
                 device: torch.device, sizes: tuple[int, ...] = CAPTURE_SIZES, tokens_per_seq: tuple[int, ...] = (1,),
                 state_slots: bool = False):
        """``state_slots``: the model reads ``ForwardBatch.state_slots`` (a graph input like the others)."""
        self.model = model
        self.sizes = [s for s in sizes if s <= max_num_seqs] or [max_num_seqs]
        self.tokens_per_seq = tokens_per_seq
        self.max_seq_len = max_seq_len
        n, t = self.sizes[-1], self.sizes[-1] * max(tokens_per_seq)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.state_slots = torch.full((n,), -1, dtype=torch.int64, device=device) if state_slots else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (size, tokens per sequence) -> graph
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # graph outputs, [size x q, vocab], model dtype

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int, q: int = 1) -> int | None:
        """The captured size a decode step of num_seqs sequences of q tokens runs at; None: run it eagerly."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) and (self.sizes[i], q) in self.graphs else None

    def _batch(self, size: int, q: int) -> ForwardBatch:
        t = size * q
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            logits_indices=self.positions[:0], max_query_len=q, max_seq_len=self.max_seq_len,
            state_slots=None if self.state_slots is None else self.state_slots[:size],
            graphed=True,  # captured, or the warm-up before a capture: the graphs' paths (layers.streams)
        )

    def _forward(self, size: int, q: int) -> torch.Tensor:
        batch = self._batch(size, q)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden, upcast=False)  # the sampler upcasts when it must

    @torch.inference_mode()
    def capture(self, pool, stream: torch.cuda.Stream, tokens_per_seq: tuple[int, ...] | None = None) -> None:
        """Capture every size, largest first, into ``pool`` on ``stream`` (smaller graphs reuse the largest one's
        memory), for each number of tokens per sequence (``tokens_per_seq``: these only; None: all)."""
        started = time.perf_counter()
        # all-padding inputs: nothing is stored, attention skips every row
        self.slot_mapping.fill_(-1)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        if self.state_slots is not None:
            self.state_slots.fill_(-1)
        for q in tokens_per_seq or self.tokens_per_seq:
            try:
                for size in reversed(self.sizes):
                    self._forward(size, q)  # warm-up: compiles kernels and sets up cuBLAS outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.logits[size, q] = self._forward(size, q)
                    self.graphs[size, q] = graph
            except Exception as exc:  # a forward that syncs or allocates on the host: those steps run eagerly
                logger.warning("CUDA graph capture of %d-token decode failed (%s: %s); it runs eagerly", q,
                               type(exc).__name__, exc)
                for key in [key for key in self.graphs if key[1] == q]:
                    del self.graphs[key], self.logits[key]
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s, tokens per sequence %s) in %.1f s",
                    len(self.graphs), self.sizes, self.tokens_per_seq, time.perf_counter() - started)

    def load_inputs(self, host: HostInputs, size: int, q: int = 1) -> None:
        """Copy one decode step's host arrays into the graph's buffers (padding rows reset)."""
        n = len(host.seq_lens)
        pad, t = size - n, size * q
        pad_tokens = t - len(host.input_ids)
        arrays = [np.pad(host.input_ids, (0, pad_tokens)), np.pad(host.positions, (0, pad_tokens)),
                  np.pad(host.slot_mapping, (0, pad_tokens), constant_values=-1), np.pad(host.seq_lens, (0, pad)),
                  np.pad(host.query_start_loc, (0, pad), mode="edge"), host.block_tables]
        if self.state_slots is not None:
            if host.state_slots is None:
                raise ValueError("this model's decode graphs read state slots, but the step's inputs carry none")
            arrays.append(np.pad(host.state_slots, (0, pad), constant_values=-1))
        ids, positions, slots, seq_lens, qsl, tables, *state = to_device_packed(arrays, self.input_ids.device)
        self.input_ids[:t].copy_(ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(slots)
        self.seq_lens[:size].copy_(seq_lens)
        self.query_start_loc[:size + 1].copy_(qsl)
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        if state:
            self.state_slots[:size].copy_(state[0])

    def replay(self, size: int, q: int = 1) -> torch.Tensor:
        """Run the graph of (`size`, `q`) on the loaded inputs; returns its logits buffer [size x q, vocab]."""
        self.graphs[size, q].replay()
        return self.logits[size, q]


def graph_modes(model: nn.Module, deterministic: bool, mtp: bool) -> tuple[bool, bool]:
    """(eager only, prompt graphs) from the model's class flags: ``eager_only`` (its forward reads its batch on
    the host: no graph, no warm-up on dummy batches; so with an MTP drafter, whose layer is not captured),
    ``eager_when_deterministic`` (so in the deterministic mode), ``prompt_graphs`` (False: prompt steps run
    eagerly, without piecewise graphs or a dummy-batch warm-up). ``multi_token_decode_graphs`` is read where the
    decode graphs are sized."""
    eager_only = (getattr(model, "eager_only", False) or mtp
                  or (deterministic and getattr(model, "eager_when_deterministic", False)))
    return eager_only, getattr(model, "prompt_graphs", True)
