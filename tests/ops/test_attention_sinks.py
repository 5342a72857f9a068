"""Attention sinks (GPT-OSS): one logit per query head in the softmax's denominator, on every attention path
(torch reference, Triton prefill and split-KV decode, the deterministic mode's torch and Triton recipes), each
against a float64 loop over query rows written here."""

from __future__ import annotations

import pytest
import torch

from dsinfer.batch_invariant.attention import paged_attention_invariant
from dsinfer.ops import paged_attention
from dsinfer.ops.attention import paged_attention_ref
from tests.ops.test_attention import LAYOUTS, _batch


def _naive(q, cache, block_tables, query_start_loc, seq_lens, scale, window, sinks):
    """Row by row in float64: scores of the visible keys and the head's sink, softmax, the sink column dropped."""
    q, cache, sinks = q.double().cpu(), cache.double().cpu(), sinks.double().cpu()
    out = torch.zeros_like(q)
    qsl, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.cpu()
    heads, kv_heads, block_size = q.shape[1], cache.shape[3], cache.shape[2]
    for b in range(len(lens)):
        n = qsl[b + 1] - qsl[b]
        for i in range(n):
            pos = lens[b] - n + i
            first = 0 if window is None else max(pos - window + 1, 0)
            keys = torch.arange(first, pos + 1)
            blocks = tables[b, keys // block_size].long()
            k, v = cache[0, blocks, keys % block_size], cache[1, blocks, keys % block_size]  # [S, Hkv, D]
            for h in range(heads):
                kh = h // (heads // kv_heads)
                logits = torch.cat([k[:, kh] @ q[qsl[b] + i, h] * scale, sinks[h:h + 1]])
                out[qsl[b] + i, h] = logits.softmax(0)[:-1] @ v[:, kh]
    return out


def _sinks(heads: int, device) -> torch.Tensor:
    # large enough to take a visible share of the weight from the keys (scores are O(1) here)
    return (torch.randn(heads, generator=torch.Generator().manual_seed(11)) * 2).to(device)


CASES = [("decode", None), ("decode", 10), ("prefill", None), ("prefill", 7), ("mixed", 20), ("prefix", None),
         ("prefix", 25)]


@pytest.mark.parametrize("layout,window", CASES)
def test_reference_with_sinks_matches_row_loop(layout, window):
    args = _batch(*LAYOUTS[layout], 8, 2, 32, 16, torch.float32, "cpu", seed=3)
    sinks = _sinks(8, "cpu")
    clean = torch.nan_to_num(args[1])
    out = paged_attention_ref(args[0], clean, *args[2:], 0.3, window, sinks=sinks)
    torch.testing.assert_close(out.double(), _naive(*args, 0.3, window, sinks), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,window", [("decode", 10), ("prefill", 7), ("mixed", 20), ("prefix", 25)])
def test_triton_with_sinks_matches_row_loop(layout, window, device, assert_close):
    args = _batch(*LAYOUTS[layout], 6, 2, 48, 16, torch.float32, device, seed=4)  # group of 3, padded
    sinks = _sinks(6, device)
    out = paged_attention(*args, 0.3, window, sinks=sinks)
    assert_close(out, _naive(*args, 0.3, window, sinks), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_splits_fold_the_sink_once(num_splits, device, assert_close):
    from dsinfer.ops.triton.attention import paged_attention_triton

    args = _batch([1] * 4, [70, 5, 128, 33], 8, 2, 32, 16, torch.float32, device, seed=5)
    sinks = _sinks(8, device)
    out = paged_attention_triton(*args, 0.2, None, max_query_len=1, num_splits=num_splits, sinks=sinks)
    assert_close(out, _naive(*args, 0.2, None, sinks), torch.float32)


def test_sinks_change_the_output():
    args = _batch(*LAYOUTS["mixed"], 4, 2, 32, 16, torch.float32, "cpu", seed=6)
    clean = (args[0], torch.nan_to_num(args[1]), *args[2:])
    plain = paged_attention_ref(*clean, 0.3)
    assert not torch.allclose(plain, paged_attention_ref(*clean, 0.3, sinks=_sinks(4, "cpu")), atol=1e-3)


@pytest.mark.parametrize("window", [None, 7])
def test_invariant_torch_with_sinks_matches_and_is_batch_invariant(window):
    args = _batch([20], [30], 4, 2, 16, 16, torch.float32, "cpu", seed=7)
    q, cache, tables, _, _ = args
    cache = torch.nan_to_num(cache)
    sinks = _sinks(4, "cpu")
    chunk = paged_attention_invariant(q, cache, *args[2:], 0.25, window, sinks=sinks)
    torch.testing.assert_close(chunk.double(), _naive(q, cache, *args[2:], 0.25, window, sinks), rtol=1e-5,
                               atol=1e-5)
    alone = paged_attention_invariant(q[-1:], cache, tables, torch.tensor([0, 1], dtype=torch.int32),
                                      torch.tensor([30], dtype=torch.int32), 0.25, window, sinks=sinks)
    assert torch.equal(alone[0], chunk[-1])


def test_invariant_triton_with_sinks_matches_row_loop(device):
    from dsinfer.batch_invariant.triton_kernels import paged_attention_invariant_triton

    args = _batch([1, 6, 1], [30, 6, 9], 4, 2, 16, 16, torch.float32, device, seed=8)  # decode rows and a prompt
    sinks = _sinks(4, device)
    for window in (None, 7):
        out = paged_attention_invariant_triton(*args, 0.25, window, 1.0, sinks)
        torch.testing.assert_close(out.double().cpu(), _naive(*args, 0.25, window, sinks), rtol=1e-4, atol=1e-4)
