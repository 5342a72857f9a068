"""DeepSeek-V3.2's ops: the indexer scores + top-k and sparse MLA. The torch references against oracles written
out here (and dense MLA), then the Triton kernels against the references (the CPU interpreter without CUDA)."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.indexer import (
    indexer_scores,
    indexer_scores_ref,
    indexer_topk,
    row_positions,
    select_topk,
    store_index_keys,
    store_index_keys_ref,
)
from dsinfer.ops.mla import mla_decode_ref
from dsinfer.ops.sparse_mla import selected_slots, sparse_mla, sparse_mla_ref
from tests.ops.test_mla_triton import _latent_batch


def _scores_oracle(q, w, cache, tables, q_lens, ctx_lens, scale):
    """sum_h w[h] * relu(scale * q[h] . k[j]) for j <= the row's position, one row and key at a time."""
    block_size = cache.shape[1]
    out = torch.full((q.shape[0], max(ctx_lens)), float("-inf"), dtype=torch.float64)
    row = 0
    for b, (n, length) in enumerate(zip(q_lens, ctx_lens)):
        for i in range(n):
            for j in range(length - n + i + 1):
                k = cache[tables[b, j // block_size], j % block_size].double()
                out[row, j] = sum(float(w[row, h]) * max(0.0, scale * float(q[row, h].double() @ k))
                                  for h in range(q.shape[1]))
            row += 1
    return out


CASES = [([1, 1, 3], [5, 40, 21]), ([4, 1], [4, 33])]


@pytest.mark.parametrize("q_lens, ctx_lens", CASES)
def test_indexer_scores_ref_is_the_formula(q_lens, ctx_lens):
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, 1, 16, 0, 8, torch.float32, "cpu")
    q = torch.randn(sum(q_lens), 3, 16, generator=gen)
    w = torch.randn(q.shape[0], 3, generator=gen)
    got = indexer_scores_ref(q, w, cache, tables, qsl, seq_lens, 0.25, max(ctx_lens))
    want = _scores_oracle(q, w, torch.nan_to_num(cache), tables, q_lens, ctx_lens, 0.25)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.allclose(got[~got.isinf()].double(), want[~want.isinf()], atol=1e-5)


def test_select_topk_keeps_the_best_visible_keys():
    inf = float("-inf")
    scores = torch.tensor([[0.5, 2.0, -1.0, 3.0, inf], [1.0, inf, inf, inf, inf]])
    got = select_topk(scores, 3)
    assert got[0].tolist() == [0, 1, 3]
    assert got[1].tolist() == [0, -1, -1]  # one visible key: it, and nothing else
    assert select_topk(scores, 8).shape == (2, 5)


def test_row_positions_follow_the_batch_layout():
    seq, pos = row_positions(torch.tensor([0, 1, 4, 6]), torch.tensor([7, 3, 10]), 6)
    assert seq.tolist() == [0, 1, 1, 1, 2, 2] and pos.tolist() == [6, 0, 1, 2, 8, 9]


def test_store_index_keys_ref_skips_padding_slots():
    cache = torch.zeros(2, 4, 3)
    store_index_keys_ref(torch.arange(9.0).view(3, 3), cache, torch.tensor([5, -1, 0]))
    assert cache.view(-1, 3)[5].tolist() == [0, 1, 2] and cache.view(-1, 3)[0].tolist() == [6, 7, 8]
    assert int((cache != 0).sum()) == 5  # nothing else written (key [0, 1, 2] has one zero)


def test_sparse_mla_over_every_position_is_dense_mla():
    q_lens, ctx_lens = [1, 1, 1], [5, 40, 21]
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, 4, 32, 8, 16, torch.float64, "cpu")
    qn, qp = torch.randn(3, 4, 32, generator=gen).double(), torch.randn(3, 4, 8, generator=gen).double()
    width = max(ctx_lens)
    positions = torch.arange(width).expand(3, width).clone()
    positions[positions >= seq_lens.unsqueeze(1)] = -1
    seq, _ = row_positions(qsl, seq_lens, 3)
    slots = selected_slots(positions, seq, tables, cache.shape[1])
    dense = mla_decode_ref(qn, qp, torch.nan_to_num(cache), tables, qsl, seq_lens, 0.3)  # (pads past a context)
    assert torch.allclose(sparse_mla_ref(qn, qp, cache, slots, 0.3), dense, atol=1e-12)
    # a strict subset is another attention (the selection is not ignored)
    assert not torch.allclose(sparse_mla_ref(qn, qp, cache, slots[:, :4], 0.3), dense, atol=1e-3)


# ---- the Triton kernels against the references ----

TRITON_CASES = [
    # (q_lens, ctx_lens, index heads, index dim, heads, rank, rope, block_size, topk, dtype)
    ([1, 1, 3], [5, 40, 21], 8, 16, 4, 32, 8, 16, 8, torch.float32),  # the tiny parity model's shapes
    ([4, 1], [4, 70], 3, 20, 20, 32, 16, 8, 16, torch.float32),  # ragged head counts and dims, two head tiles
    ([1, 2], [50, 9], 8, 16, 4, 32, 16, 16, 12, torch.bfloat16),
]


@pytest.mark.parametrize("q_lens, ctx_lens, ih, idim, heads, rank, rope, block_size, topk, dtype", TRITON_CASES)
def test_triton_indexer_and_sparse_mla_match_references(q_lens, ctx_lens, ih, idim, heads, rank, rope,
                                                        block_size, topk, dtype, device, assert_close, poisoned):
    latent, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, heads, rank, rope, block_size, dtype,
                                                       device)
    keys = _latent_batch(q_lens, ctx_lens, 1, idim, 0, block_size, dtype, device, seed=0)[0]
    latent, keys = torch.nan_to_num(latent), torch.nan_to_num(keys)
    num_rows, width = sum(q_lens), max(ctx_lens)
    iq = torch.randn(num_rows, ih, idim, generator=gen).to(dtype).to(device)
    w = torch.randn(num_rows, ih, generator=gen).to(device)
    scores = indexer_scores(iq, w, keys, tables, qsl, seq_lens, idim**-0.5, width)
    ref = indexer_scores_ref(iq, w, keys, tables, qsl, seq_lens, idim**-0.5, width)
    assert torch.equal(scores.isinf(), ref.isinf())
    finite = ~ref.isinf()
    assert_close(scores[finite], ref[finite], dtype)
    chosen = indexer_topk(iq, w, keys, tables, qsl, seq_lens, idim**-0.5, topk, width)
    if dtype == torch.float32:  # no near ties at float32: the same keys
        want = select_topk(ref, topk)
        assert [sorted(r) for r in chosen.tolist()] == [sorted(r) for r in want.tolist()]
    seq, _ = row_positions(qsl, seq_lens, num_rows)
    slots = selected_slots(chosen, seq, tables, block_size)
    stored, want = keys.clone(), keys.clone()
    new_keys = torch.randn(num_rows, idim, generator=gen).to(dtype).to(device)
    new_slots = torch.randperm(keys.shape[0] * block_size, generator=gen)[:num_rows].to(device)
    new_slots[0] = -1  # padding
    store_index_keys(new_keys, stored, new_slots)
    store_index_keys_ref(new_keys, want, new_slots)
    assert torch.equal(stored, want) and not torch.equal(stored, keys)
    qn = torch.randn(num_rows, heads, rank, generator=gen).to(dtype).to(device)
    qp = torch.randn(num_rows, heads, rope, generator=gen).to(dtype).to(device)
    out = sparse_mla(qn, qp, latent, slots, rank**-0.5)
    assert_close(out, sparse_mla_ref(qn, qp, latent, slots, rank**-0.5), dtype)


def test_padding_rows_of_a_graph_select_nothing(device):
    """A CUDA graph pads the step with rows past query_start_loc[B] (empty queries, seq_len 0, slot -1): they
    score every key -inf, select no slot and attend to nothing (zeros, no NaN), reading only real memory."""
    keys = torch.randn(4, 8, 16).to(device)
    tables = torch.tensor([[2, 1], [0, 0]], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 1], dtype=torch.int32, device=device)  # one real row, then a padding sequence
    seq_lens = torch.tensor([11, 0], dtype=torch.int32, device=device)
    q, w = torch.randn(3, 2, 16).to(device), torch.randn(3, 2).to(device)
    scores = indexer_scores(q, w, keys, tables, qsl, seq_lens, 0.25, 16)
    assert torch.isfinite(scores[0, :11]).all() and scores[0, 11:].isinf().all() and scores[1:].isinf().all()
    chosen = select_topk(scores, 4)
    seq, _ = row_positions(qsl, seq_lens, 3)
    slots = selected_slots(chosen, seq, tables, 8)
    assert seq.tolist() == [0, 1, 1] and (slots[1:] == -1).all() and (slots[0] >= 0).all()
    latent, qn, qp = torch.randn(4, 8, 40).to(device), torch.randn(3, 4, 32).to(device), torch.randn(3, 4, 8).to(device)
    for out in (sparse_mla(qn, qp, latent, slots, 0.2), sparse_mla_ref(qn, qp, latent, slots, 0.2)):
        assert torch.isfinite(out).all() and (out[1:] == 0).all()


def test_scores_in_row_chunks_equal_one_pass(monkeypatch, device):
    """indexer_topk scores a bounded number of rows at a time (``SCORE_ROWS_BUDGET``): chunks that cut through
    sequences give the one-pass selection, on the kernel and on the reference."""
    import dsinfer.ops.indexer as indexer_ops

    q_lens, ctx_lens = [3, 1, 5], [20, 9, 33]
    keys, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, 1, 16, 0, 8, torch.float32, device)
    keys = torch.nan_to_num(keys)
    q, w = torch.randn(9, 4, 16, generator=gen).to(device), torch.randn(9, 4, generator=gen).to(device)
    args = (q, w, keys, tables, qsl, seq_lens, 0.25)
    whole = indexer_topk(*args, 6, 33)
    ref = indexer_scores_ref(*args, 33)
    assert torch.equal(torch.cat([indexer_scores_ref(*args, 33, (a, b)) for a, b in ((0, 2), (2, 7), (7, 9))]), ref)
    monkeypatch.setattr(indexer_ops, "SCORE_ROWS_BUDGET", 2 * 33)  # two rows a pass
    assert torch.equal(indexer_topk(*args, 6, 33), whole)
