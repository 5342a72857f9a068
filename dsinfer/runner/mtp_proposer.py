"""MTP drafts, computed by the worker right after the target's forward of a step (DeepSeek-V3 / V3.2 / V4).

The MTP layer at position i reads the target's last hidden state h_i and the token t_{i+1} after it, and predicts
t_{i+2} (``models.mtp``; V4: ``models.deepseek_v4.mtp``, whose h_i is the target's hyper-connection streams). Its
KV lives in its own cache, one more layer of the KV spec: V3's latent KV paged by the same block ids as the
target's, V4's window ring (and compressors' rows) in the request's own state slot and its compressed entries in
the same blocks; so the step's slot mapping, block tables and state slots serve it unchanged. The V4 ring holds
``window + num_speculative_tokens`` rows like the target's, so positions past the last kept one (a rejected
draft's, a chained depth's) never overwrite a row a later step reads.

Depth 0 runs over every row of the step, beside the target: row i's next token is the step's input at row i + 1,
a request's last row of a prompt chunk reads the next prompt token, and every sampled row reads its own sampled
token. A row up to the last kept draft then holds its true (h_i, t_{i+1}), so the MTP KV of every position the
target keeps is exact, written in the same step as the target's. Rows past a rejected draft hold a wrong token:
their MTP KV (like the target's KV there) belongs to no kept position, and the next step's depth 0 starts at
those positions again (they are its first uncomputed ones) and stores their KV before any query reads it
(attention is causal and the store comes first), so nothing reads it. The draft of a request is the MTP
output at its last kept row: argmax of its logits, confidence its softmax probability.

Depth j >= 1 chains the first MTP layer on its own output: position p + j, the hidden state the layer gave at
p + j - 1, the draft of depth j - 1 as the next token. Its KV writes go to positions past the request's last
computed one, overwritten by the next step's depth 0 before they are read. A chained position must lie in a
block the request holds this step; where it does not the request's drafts stop there (fewer drafts, never a write
outside its blocks).

A prefix-cache hit reads the MTP KV the cached blocks were written with: exact, except at a block's last
position, whose entry read the next token of the request that wrote it (a later request may go on differently);
that changes a draft's quality, never the output (verification keeps only the target's tokens).

Steps with MTP run synchronously (the engine drains the pipeline while a drafter is on), so every input id of
the step is on the host. Checkpoints with more than one MTP layer draft with the first one only: a later layer at
position i needs t_{i+1+k}, which this step-aligned schedule does not keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.runner.input_batch import StepInputs, to_device_packed


@dataclass
class _Picked:
    """Per sampling request: its id, the batch row of its last kept position, that position, its block ids, its
    state slot (-1: the model keeps no per-sequence state)."""

    request_ids: list[str]
    rows: np.ndarray
    positions: np.ndarray
    block_ids: list[list[int]]
    state_slots: list[int]


class MTPProposer:
    def __init__(self, mtp: torch.nn.Module, num_drafts: int, block_size: int, device: torch.device):
        """``mtp``: the model's ``DeepseekMTP``; ``num_drafts``: drafts per request (``num_speculative_tokens``)."""
        self.mtp, self.num_drafts, self.block_size, self.device = mtp, num_drafts, block_size, device

    def propose(self, inputs: StepInputs, hidden: torch.Tensor, tokens: list[int]
                ) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
        """``hidden``: the target's last hidden states of every row [T, D]; ``tokens``: the step's sampled tokens
        (one per sample row, host) -> (draft ids, confidences) per request that sampled. One host sync. A step of
        prompt chunks only (no sampled row) still runs depth 0: its positions' MTP KV."""
        next_ids, picked = self._depth0_inputs(inputs, tokens)
        batch = inputs.batch
        next_d, rows_d = to_device_packed([next_ids, picked.rows], self.device)
        layer = self.mtp.layers[0]
        out = layer(hidden, next_d, batch.positions, batch)  # every row: the MTP KV of the step's positions
        if not picked.request_ids:  # prompt chunks only
            return {}, {}
        out = out[rows_d]
        conf, ids = layer.shared_head(out).softmax(-1).max(-1)
        alive = np.arange(len(picked.request_ids))
        depths = [(alive, ids, conf)]
        room = np.array([len(b) for b in picked.block_ids]) * self.block_size
        for depth in range(1, self.num_drafts):
            positions = picked.positions[alive] + depth
            fits = positions < room[alive]
            if not fits.any():
                break
            if not fits.all():  # chained positions past the blocks it holds: that request's drafts end here
                sel = np.flatnonzero(fits)
                (sel_d,) = to_device_packed([sel], self.device)
                alive, positions, ids, out = alive[sel], positions[sel], ids[sel_d], out[sel_d]
            chain = self._chain_batch(ids, positions, [picked.block_ids[i] for i in alive],
                                      [picked.state_slots[i] for i in alive])
            out = layer(out, ids, chain.positions, chain)
            conf, ids = layer.shared_head(out).softmax(-1).max(-1)
            depths.append((alive, ids, conf))
        ids_host = torch.cat([d[1] for d in depths]).tolist()
        conf_host = torch.cat([d[2] for d in depths]).tolist()
        drafts: dict[str, list[int]] = {rid: [] for rid in picked.request_ids}
        confidence: dict[str, list[float]] = {rid: [] for rid in picked.request_ids}
        offset = 0
        for alive, _, _ in depths:
            for j, i in enumerate(alive.tolist()):
                rid = picked.request_ids[i]
                drafts[rid].append(ids_host[offset + j])
                confidence[rid].append(conf_host[offset + j])
            offset += len(alive)
        return drafts, confidence

    def _depth0_inputs(self, inputs: StepInputs, tokens: list[int]) -> tuple[np.ndarray, _Picked]:
        """The next token of every row (see the module doc) and, per sampling request, its last kept row."""
        host, rows = inputs.host, inputs.sample_rows
        if inputs.placeholder_rows:
            raise RuntimeError("MTP drafting needs every input id on the host: its steps must run synchronously")
        qsl = host.query_start_loc
        next_ids = np.zeros_like(host.input_ids)
        next_ids[:-1] = host.input_ids[1:]
        picked = _Picked([], np.zeros(0, np.int64), np.zeros(0, np.int64), [], [])
        picked_rows, picked_positions = [], []
        j = 0
        for i, state in enumerate(inputs.states):
            start, end = int(qsl[i]), int(qsl[i + 1])
            m = 0
            while j + m < len(rows) and rows[j + m].state is state:
                m += 1
            if not m:  # a prompt chunk short of the last token: its next token is known
                next_ids[end - 1] = state.token_ids[state.num_computed_tokens + end - start]
                continue
            first = end - m
            next_ids[first:end] = tokens[j:j + m]
            kept = 0
            while kept < m - 1 and tokens[j + kept] == rows[j + kept].draft:
                kept += 1
            picked.request_ids.append(state.request_id)
            picked.block_ids.append(state.block_ids[0])
            picked.state_slots.append(state.state_slot)
            picked_rows.append(first + kept)
            picked_positions.append(int(host.positions[first + kept]))
            j += m
        picked.rows = np.asarray(picked_rows, np.int64)
        picked.positions = np.asarray(picked_positions, np.int64)
        return next_ids, picked

    def _chain_batch(self, ids: torch.Tensor, positions: np.ndarray, block_ids: list[list[int]],
                     state_slots: list[int]) -> ForwardBatch:
        """One token a request at ``positions``, in the requests' own blocks and state slots."""
        bs, n = self.block_size, len(positions)
        tables = np.zeros((n, max(len(b) for b in block_ids)), dtype=np.int32)
        for r, blocks in enumerate(block_ids):
            tables[r, :len(blocks)] = blocks
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (positions + 1).astype(np.int32)
        pos_d, slots_d, tables_d, qsl_d, lens_d, logits_d, state_d = to_device_packed(
            [positions, slots, tables, np.arange(n + 1, dtype=np.int32), seq_lens, np.arange(n, dtype=np.int64),
             np.asarray(state_slots, np.int64)], self.device)
        return ForwardBatch(input_ids=ids, positions=pos_d, slot_mapping=slots_d, block_tables=tables_d,
                            query_start_loc=qsl_d, seq_lens=lens_d, logits_indices=logits_d, max_query_len=1,
                            max_seq_len=int(seq_lens.max()), state_slots=state_d if state_slots[0] >= 0 else None)
