"""Batch-invariant ops: a row's bits do not depend on its companions (CPU torch path and Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsinfer.batch_invariant import batch_invariant, elementwise, is_enabled
from dsinfer.batch_invariant.attention import paged_attention_invariant
from dsinfer.batch_invariant.matmul import bmm_invariant, mm_invariant
from dsinfer.ops.attention import paged_attention_ref
from dsinfer.ops.moe import Routing, select_experts

HAS_CUDA = torch.cuda.is_available()


def test_linear_rows_are_invariant_to_batch_size_and_position():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=gen)
    x = torch.randn(600, 96, generator=gen)
    full = mm_invariant(x, w.t())
    for m in (1, 2, 3, 5, 17, 255, 256, 257, 600):
        assert torch.equal(mm_invariant(x[:m], w.t()), full[:m]), m
    for start in (1, 7, 300, 599):
        assert torch.equal(mm_invariant(x[start:start + 1], w.t()), full[start:start + 1])
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-5, atol=1e-5)


def test_linear_rows_invariant_where_mkl_accumulates_by_batch_size():
    """[M, 960] @ [960, 2560]: on an AVX512 Xeon, plain MKL calls give a row other bits at M = 16 than at M = 256
    (the calls of a fixed row count do not)."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2560, 960, generator=gen)
    x = torch.randn(300, 960, generator=gen)
    full = mm_invariant(x, w.t())
    for m in (1, 16, 17, 100, 256, 257):
        assert torch.equal(mm_invariant(x[:m], w.t()), full[:m]), m
    both = bmm_invariant(torch.stack((x[:100], x[100:200])), torch.stack((w.t(), w.t())))
    for rows in (slice(40, 57), slice(99, 100)):  # one item, or two: the bmm path of every call
        assert torch.equal(bmm_invariant(x[None, rows], w.t()[None])[0], both[0, rows])


def test_sigmoid_and_silu_bits_do_not_depend_on_position():
    """torch's CPU sigmoid / SiLU finish a vectorized loop's tail with the scalar function, whose last bit differs:
    the invariant ones give one value wherever the element sits, correctly rounded on these samples."""
    gen = torch.Generator().manual_seed(5)
    probe = torch.tensor([0.3711, -2.5, 7.25, -95.0, 30.0])
    for fn in (elementwise.sigmoid, elementwise.silu):
        seen = {tuple(fn(torch.cat((torch.randn(n, generator=gen), probe)))[-5:].tolist()) for n in range(70)}
        assert len(seen) == 1
        x = torch.randn(20000, generator=gen) * 12
        ref = torch.sigmoid(x.double()) if fn is elementwise.sigmoid else F.silu(x.double())
        assert torch.equal(fn(x), ref.float())
        # the invariant attention's softmax uses torch.exp as is: its CPU kernel (MKL's vector math) has no
        # scalar tail, which this checks on the machine at hand
        seen = {tuple(torch.exp(torch.cat((torch.randn(n, generator=gen), probe)))[-5:].tolist())
                for n in (*range(70), 40001, 65599)}
        assert len(seen) == 1
    edges = torch.tensor([float("nan"), float("inf"), -float("inf"), -104.0, 0.0])
    assert torch.equal(elementwise.sigmoid(edges)[1:], torch.tensor([1.0, 0.0, 0.0, 0.5]))
    assert elementwise.sigmoid(edges)[0].isnan() and elementwise.silu(edges)[0].isnan()
    assert elementwise.silu(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_softplus_bits_do_not_depend_on_position():
    """DeepSeek-V4's router scores sqrt(softplus(logit)): the invariant softplus gives one value wherever the
    element sits, correctly rounded on these samples, and the mode routes F.softplus there."""
    gen = torch.Generator().manual_seed(6)
    probe = torch.tensor([0.3711, -2.5, 7.25, -95.0, 30.0])
    seen = {tuple(elementwise.softplus(torch.cat((torch.randn(n, generator=gen), probe)))[-5:].tolist())
            for n in range(70)}
    assert len(seen) == 1
    x = torch.randn(20000, generator=gen) * 12
    assert torch.equal(elementwise.softplus(x), F.softplus(x.double()).float())
    edges = elementwise.softplus(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0]))
    assert edges[0].isnan() and torch.equal(edges[1:], torch.tensor([float("inf"), 0.0, 0.6931471824645996]))
    with batch_invariant():
        assert torch.equal(F.softplus(x), elementwise.softplus(x))


def test_sigmoid_router_weights_same_alone_and_in_batch():
    """A DeepSeek-V3 router over 8 experts (8 sigmoids per token: shorter than one AVX512 loop step)."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 8, generator=gen)
    routing = Routing("sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5)
    bias = torch.randn(8, generator=gen) * 0.1
    with batch_invariant():
        full_w, full_ids = select_experts(logits, 2, routing, bias)
        for m in (1, 2, 3, 43, 55, 63):
            w, ids = select_experts(logits[:m], 2, routing, bias)
            assert torch.equal(w, full_w[:m]) and torch.equal(ids, full_ids[:m]), m
        for start in (0, 13, 63):
            w, _ = select_experts(logits[start:start + 1], 2, routing, bias)
            assert torch.equal(w, full_w[start:start + 1])
    plain_w, plain_ids = select_experts(logits, 2, routing, bias)
    torch.testing.assert_close(full_w, plain_w.gather(1, plain_ids.sort(dim=-1).indices), rtol=1e-6, atol=1e-6)


def test_mode_routes_linear_and_refuses_nesting():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 32, generator=gen), torch.randn(9, 32, generator=gen)
    with batch_invariant():
        assert is_enabled()
        one = F.linear(x[:1], w)
        many = F.linear(x, w)
        with pytest.raises(RuntimeError, match="does not nest"), batch_invariant():
            pass
    assert not is_enabled()
    assert torch.equal(one, many[:1])
    with batch_invariant(False):
        assert not is_enabled()


def test_bmm_invariant_to_batch_count():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 3, 64, generator=gen), torch.randn(6, 64, 80, generator=gen)
    full = bmm_invariant(a, b)
    assert torch.equal(bmm_invariant(a[:1], b[:1]), full[:1])
    assert torch.equal(bmm_invariant(a[2:5], b[2:5]), full[2:5])


def _cache(num_blocks=40, block_size=4, hkv=2, d=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)


def _call(fn, q, cache, tables, q_lens, seq_lens, window=None):
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return fn(q, cache, torch.tensor(tables, dtype=torch.int32), qsl, torch.tensor(seq_lens, dtype=torch.int32),
              0.25, window)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_row_same_in_prefill_chunk_decode_batch_and_alone(window):
    cache = _cache()
    gen = torch.Generator().manual_seed(4)
    table_a = list(range(0, 10))
    table_b = list(range(10, 40))
    q = torch.randn(20, 4, 16, generator=gen)
    # sequence A: a prefill chunk of 20 queries ending at position 29 (context 30)
    chunk = _call(paged_attention_invariant, q, cache, [table_a], [20], [30], window)
    # its last row as a decode, alone and next to a long companion
    alone = _call(paged_attention_invariant, q[-1:], cache, [table_a], [1], [30], window)
    q2 = torch.cat((torch.randn(1, 4, 16, generator=gen), q[-1:]))
    batched = _call(paged_attention_invariant, q2, cache, [table_b, table_a + [0] * 20], [1, 1], [117, 30], window)
    assert torch.equal(alone[0], chunk[-1])
    assert torch.equal(batched[1], chunk[-1])
    ref = _call(paged_attention_ref, q, cache, [table_a], [20], [30], window)
    torch.testing.assert_close(chunk, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def triton_interpreter(monkeypatch):
    if not HAS_CUDA:  # set before triton's first import, which reads it
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    return "cuda" if HAS_CUDA else "cpu"


def test_triton_matmul_rows_invariant(triton_interpreter):
    from dsinfer.batch_invariant.triton_kernels import matmul_invariant_triton

    gen = torch.Generator().manual_seed(5)
    a = torch.randn(130, 48, generator=gen).to(triton_interpreter)
    b = torch.randn(48, 70, generator=gen).to(triton_interpreter)
    full = matmul_invariant_triton(a, b)
    torch.testing.assert_close(full.cpu(), (a @ b).cpu(), rtol=1e-4, atol=1e-4)
    for m, start in ((1, 0), (3, 64), (1, 129), (70, 60)):
        assert torch.equal(matmul_invariant_triton(a[start:start + m], b), full[start:start + m])
    # a batch of products (one launch) gives each product's bits
    a3 = torch.stack((a[:70], a[60:130])).transpose(1, 2).contiguous().transpose(1, 2)  # strided rows
    batched = matmul_invariant_triton(a3, torch.stack((b, b)))
    assert torch.equal(batched[0], full[:70]) and torch.equal(batched[1], full[60:130])


def test_triton_attention_matches_reference_and_is_invariant(triton_interpreter):
    from dsinfer.batch_invariant.triton_kernels import paged_attention_invariant_triton

    dev = triton_interpreter
    cache = _cache().to(dev)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(20, 4, 16, generator=gen).to(dev)
    tables = [list(range(0, 10))]
    chunk = _call(paged_attention_invariant_triton, q, cache, [t for t in tables], [20], [30])
    ref = _call(paged_attention_ref, q.cpu(), cache.cpu(), tables, [20], [30])
    torch.testing.assert_close(chunk.cpu(), ref, rtol=1e-4, atol=1e-4)
    q2 = torch.cat((torch.randn(1, 4, 16, generator=gen).to(dev), q[-1:]))
    batched = _call(paged_attention_invariant_triton, q2, cache, [list(range(10, 40)), tables[0] + [0] * 20],
                    [1, 1], [117, 30])
    assert torch.equal(batched[1], chunk[-1])


def test_triton_attention_skips_padding_rows(triton_interpreter):
    """Rows past the last query row (a CUDA graph's padded batch) are skipped, not mapped out of bounds."""
    from dsinfer.batch_invariant.triton_kernels import paged_attention_invariant_triton

    dev = triton_interpreter
    cache = _cache().to(dev)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 16, generator=gen).to(dev)
    tables = [list(range(10, 40)), list(range(0, 10)) + [0] * 20]
    real = _call(paged_attention_invariant_triton, q, cache, tables, [1, 1], [117, 30])
    padded_q = torch.cat((q, torch.randn(3, 4, 16, generator=gen).to(dev)))
    padded = _call(paged_attention_invariant_triton, padded_q, cache, tables, [1, 1], [117, 30])
    assert torch.equal(padded[:2], real)
