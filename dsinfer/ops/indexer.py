"""DeepSeek-V3.2's lightning indexer over a paged key cache: store each token's indexer key, score every cached key
of a sequence against each query row, keep the ``topk`` best (causal).

Key cache layout (``IndexedMLASpec``): ``[num_blocks, block_size, D]``, one key per token (D = index_head_dim), in
the same pages as the MLA latent (one block table indexes both).

The score of query row t (sequence b, position p) for key position j <= p is
``sum_h w[t, h] * relu(scale * q[t, h] . k[b, j])`` (transformers' ``DeepseekV32Indexer``: ``w`` already carries
its ``index_n_heads ** -0.5``); keys after p score -inf. Computed in float32. Batch conventions as in
``ops.mla``: sequence b owns rows ``query_start_loc[b]:query_start_loc[b+1]``, its context has ``seq_lens[b]``
tokens (this step's stored first), its queries are the last ones.
"""

from __future__ import annotations

import torch

from dsinfer.ops._common import copy_rows
from dsinfer.ops.dispatch import use_triton

SCORE_ROWS_BUDGET = 1 << 26  # float32 scores (256 MiB) that ``indexer_topk`` materializes at once


def store_index_keys(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, D] -> the cache rows ``slot_mapping`` (negative slots are padding, skipped)."""
    if use_triton(k):
        from dsinfer.ops.triton.indexer import store_index_keys_triton

        return store_index_keys_triton(k, index_cache, slot_mapping)
    store_index_keys_ref(k, index_cache, slot_mapping)


def store_index_keys_ref(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch path of ``store_index_keys`` (its filter of padding rows reads the mask on the host)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, slot_mapping = k[keep], slot_mapping[keep]
    copy_rows(index_cache.view(-1, index_cache.shape[-1]), slot_mapping, k.to(index_cache.dtype))


def row_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence [T] int64, position [T] int64) of every query row: rows of sequence b hold its last
    ``q_len[b]`` positions. No host read (a CUDA graph's padding rows, past ``query_start_loc[B]``, get the last
    sequence and a position nothing reads)."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    rows = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    seq = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True).clamp_max(q_lens.numel() - 1)
    pos = rows.long() - query_start_loc[seq].long()
    return seq, pos + (seq_lens.long() - q_lens)[seq]


def indexer_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """q [T, H, D] (roped), weights [T, H] -> scores [T, max_seq_len] float32 over key positions, -inf where the
    row cannot see the key (after its position, or past its sequence). ``rows`` = (start, end): only those query
    rows' scores, [end - start, max_seq_len] (None: every row). Sequence by sequence, 128 query rows at a time
    (bounds the [rows, H, L] product)."""
    start, end = rows or (0, q.shape[0])
    out = torch.full((end - start, max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    block_size, flat = index_cache.shape[1], index_cache.view(-1, index_cache.shape[-1])
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        first, n = starts[b], starts[b + 1] - starts[b]
        lo_row, hi_row = max(first, start), min(first + n, end)  # this sequence's rows within ``rows``
        if lo_row >= hi_row:
            continue
        pos = torch.arange(length, device=q.device)
        keys = flat[block_tables[b, pos // block_size].long() * block_size + pos % block_size].float()  # [L, D]
        for lo in range(lo_row, hi_row, 128):
            hi = min(hi_row, lo + 128)
            s = torch.relu(torch.einsum("nhd,ld->nhl", q[lo:hi].float(), keys) * scale)
            s = torch.einsum("nh,nhl->nl", weights[lo:hi].float(), s)
            q_pos = torch.arange(lo, hi, device=q.device) - first + length - n
            out[lo - start : hi - start, :length] = s.masked_fill(pos > q_pos.unsqueeze(1), float("-inf"))
    return out


def indexer_scores(q, weights, index_cache, block_tables, query_start_loc, seq_lens, scale, max_seq_len, rows=None
                   ) -> torch.Tensor:
    """See ``indexer_scores_ref``."""
    if use_triton(q):
        from dsinfer.ops.triton.indexer import indexer_scores_triton

        return indexer_scores_triton(q, weights, index_cache, block_tables, query_start_loc, seq_lens, scale,
                                     max_seq_len, rows)
    return indexer_scores_ref(q, weights, index_cache, block_tables, query_start_loc, seq_lens, scale, max_seq_len,
                              rows)


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, L] -> the positions of each row's ``min(topk, L)`` best keys [T, min(topk, L)] int32, ascending,
    then -1 in place of keys the row cannot see (rows that see fewer keys than ``topk`` keep all they see).
    Ascending: the attention over the set then sums it in one order whatever the width ``L`` of the step's
    scores (the deterministic mode's batch invariance), and gathers the cache rows in memory order."""
    values, positions = scores.topk(min(topk, scores.shape[1]), dim=-1, sorted=False)
    unseen = torch.iinfo(positions.dtype).max
    positions = positions.masked_fill(values == float("-inf"), unseen).sort(dim=-1).values
    return positions.masked_fill(positions == unseen, -1).to(torch.int32)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    topk: int,
    max_seq_len: int,
) -> torch.Tensor:
    """The key positions each query row attends to: ``select_topk(indexer_scores(...), topk)``, [T, K] int32
    with K = min(topk, max_seq_len); ``max_seq_len`` (host int) bounds ``seq_lens``. Scored ``SCORE_ROWS_BUDGET //
    max_seq_len`` rows at a time, so the float32 score matrix stays bounded (a 8k-token prefill chunk at a 128k
    context would be 4 GiB); decode steps take one pass."""
    num_rows, step = q.shape[0], max(1, SCORE_ROWS_BUDGET // max(max_seq_len, 1))
    if num_rows <= step:
        scores = indexer_scores(q, weights, index_cache, block_tables, query_start_loc, seq_lens, scale, max_seq_len)
        return select_topk(scores, topk)
    out = torch.empty(num_rows, min(topk, max_seq_len), dtype=torch.int32, device=q.device)
    for start in range(0, num_rows, step):
        rows = (start, min(num_rows, start + step))
        out[rows[0] : rows[1]] = select_topk(indexer_scores(q, weights, index_cache, block_tables, query_start_loc,
                                                            seq_lens, scale, max_seq_len, rows), topk)
    return out
