from __future__ import annotations

import math

import pytest
import torch

from dsinfer.ops import cpu_quant, paged_attention
from dsinfer.ops.attention import paged_attention_ref


def _batch(q_lens, ctx_lens, q_heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A varlen batch over a shuffled paged cache. Every cache entry no sequence owns (the tail of each last
    block, the padding columns of block_tables, one spare block) is NaN: a kernel that reads one shows it."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen)
    poison_block = int(order[-1])
    width = max(max(blocks_per_seq), 1) + 1
    block_tables = torch.full((len(q_lens), width), poison_block, dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    used = 0
    for b, n in enumerate(ctx_lens):
        ids = order[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(ids)] = ids.int()
        pos = torch.arange(n)
        kv = torch.randn(2, n, kv_heads, head_dim, generator=gen)
        cache[:, ids[pos // block_size], pos % block_size] = kv
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=gen)
    to = dict(device=device)
    return (q.to(dtype).to(**to), cache.to(dtype).to(**to), block_tables.to(**to), query_start_loc.to(**to),
            torch.tensor(ctx_lens, dtype=torch.int32, device=device))


def _reference(q, cache, block_tables, query_start_loc, seq_lens, scale, window):
    """float64 reference on CPU, over the cache with its unowned (NaN) entries zeroed."""
    clean = torch.nan_to_num(cache.double().cpu(), nan=0.0)
    return paged_attention_ref(q.double().cpu(), clean, block_tables.cpu(), query_start_loc.cpu(),
                               seq_lens.cpu(), scale, window)


LAYOUTS = {
    #               (query lengths,            context lengths)
    "decode": ([1, 1, 1, 1, 1], [1, 17, 40, 64, 33]),
    "prefill": ([9, 40, 1, 23], [9, 40, 1, 23]),
    "mixed": ([1, 30, 1, 12, 1], [50, 30, 7, 12, 16]),
    "prefix": ([5, 33, 17], [37, 70, 17]),  # cached prefix / earlier chunks, then this step's chunk
}
CASES = [
    # layout, q_heads, kv_heads, head_dim, block_size, dtype, window
    ("decode", 4, 4, 32, 16, torch.float32, None),
    ("decode", 8, 2, 64, 32, torch.bfloat16, None),
    ("decode", 16, 2, 32, 16, torch.float32, 10),
    ("prefill", 2, 2, 64, 16, torch.bfloat16, None),
    ("prefill", 8, 2, 32, 32, torch.float32, None),
    ("prefill", 16, 2, 32, 16, torch.bfloat16, 7),
    ("mixed", 4, 4, 32, 32, torch.float32, None),
    ("mixed", 8, 2, 64, 16, torch.bfloat16, None),
    ("mixed", 16, 2, 32, 16, torch.float32, 20),
    ("prefix", 2, 2, 32, 16, torch.float32, None),
    ("prefix", 8, 2, 32, 32, torch.bfloat16, 16),
    ("prefix", 16, 2, 64, 16, torch.float32, None),
    ("prefix", 6, 2, 48, 16, torch.float32, 25),  # group of 3 (padded to 4), head dim not a power of two
]


def _case_id(c) -> str:
    return f"{c[0]}-g{c[1] // c[2]}-d{c[3]}-bs{c[4]}-w{c[6]}-{str(c[5])[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_attention_matches_reference(case, device, poisoned, assert_close):
    layout, q_heads, kv_heads, head_dim, block_size, dtype, window = case
    q_lens, ctx_lens = LAYOUTS[layout]
    args = _batch(q_lens, ctx_lens, q_heads, kv_heads, head_dim, block_size, dtype, device, seed=len(case[0]))
    scale = head_dim**-0.5
    out = paged_attention(*args, scale, window)
    assert out.dtype == dtype
    assert_close(out, _reference(*args, scale, window), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits_combine_to_the_same_output(num_splits, device, assert_close):
    from dsinfer.ops.triton.attention import paged_attention_triton

    args = _batch([1] * 4, [70, 5, 128, 33], 8, 2, 32, 16, torch.float32, device, seed=5)
    out = paged_attention_triton(*args, 0.2, None, max_query_len=1, num_splits=num_splits)
    assert_close(out, _reference(*args, 0.2, None), torch.float32)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
def test_prefill_tile_sizes_give_the_same_output(block_m, block_n, device, assert_close):
    from dsinfer.ops.triton.attention import paged_attention_triton

    args = _batch([40, 3, 65], [60, 3, 65], 4, 2, 32, 16, torch.float32, device, seed=6)
    for window in (None, 24):
        out = paged_attention_triton(*args, 0.3, window, block_m=block_m, block_n=block_n)
        assert_close(out, _reference(*args, 0.3, window), torch.float32)


def test_rows_without_queries_write_nothing(device, assert_close):
    # Padding rows (no query, e.g. a CUDA-graph batch larger than the live one) must leave others' rows alone.
    q, cache, bt, _, seq_lens = _batch([1, 1, 1], [9, 20, 5], 4, 2, 32, 16, torch.float32, device, seed=7)
    qsl = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=device)  # row 1 has no query
    seq_lens[1] = 0
    ref = _reference(q[:2], cache, bt, qsl, seq_lens, 0.25, None)
    out = paged_attention(q[:2], cache, bt, qsl, seq_lens, 0.25, max_query_len=1)
    assert_close(out, ref, torch.float32)
    qsl = torch.tensor([0, 2, 2, 3], dtype=torch.int32, device=device)
    seq_lens[0], seq_lens[2] = 9, 5
    out = paged_attention(q, cache, bt, qsl, seq_lens, 0.25)  # prefill kernel, an empty row in the middle
    assert_close(out, _reference(q, cache, bt, qsl, seq_lens, 0.25, None), torch.float32)


def test_decode_with_max_query_len_reads_no_tensor_values_on_host(device, monkeypatch, assert_close):
    args = _batch([1, 1], [30, 12], 4, 1, 32, 16, torch.float32, device, seed=8)
    ref = _reference(*args, 0.2, None)

    def refuse(*_a, **_k):
        raise AssertionError("host read of a tensor value on the decode path")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = paged_attention(*args, 0.2, max_query_len=1, max_seq_len=64)
    monkeypatch.undo()
    assert_close(out, ref, torch.float32)


def test_reference_accepts_the_hints(device):
    args = _batch([1, 3], [4, 3], 2, 2, 16, 16, torch.float32, "cpu", seed=9)
    plain = paged_attention_ref(*args, 0.5)
    assert torch.equal(paged_attention_ref(*args, 0.5, max_query_len=3, max_seq_len=16), plain)


# ---- GPU: real shapes, compiled kernels (run by the device script) ----

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["decode", "mixed", "prefix"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama_shapes_on_gpu(layout, dtype, assert_close):
    lens = {"decode": ([1] * 8, [1, 700, 1500, 4096] * 2), "mixed": ([1, 300, 1, 517], [900, 300, 2, 1600]),
            "prefix": ([256, 100], [1300, 229])}[layout]
    args = _batch(*lens, 32, 8, 128, 16, dtype, "cuda", seed=10)
    for window in (None, 256):
        out = paged_attention(*args, 128**-0.5, window, max_query_len=max(lens[0]))
        torch.cuda.synchronize()
        assert_close(out, _reference(*args, 128**-0.5, window), dtype)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph_with_new_lengths(assert_close):
    args = _batch([1] * 8, [64] * 8, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    q, cache, bt, qsl, seq_lens = args
    static_lens = seq_lens.clone()
    run = lambda: paged_attention(q, cache, bt, qsl, static_lens, 0.1, max_query_len=1, max_seq_len=64)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    new_lens = torch.tensor([1, 5, 17, 64, 33, 2, 60, 40], dtype=torch.int32, device="cuda")
    static_lens.copy_(new_lens)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, _reference(q, cache, bt, qsl, new_lens, 0.1, None), torch.bfloat16)


@pytest.mark.skipif(not cpu_quant.native_available(),
                    reason="the C++ kernels did not build here")
@pytest.mark.parametrize("q_heads, kv_heads, window", [(9, 3, None), (4, 4, None), (16, 2, 10)])
def test_cpu_decode_kernel_matches_the_reference_and_reads_only_owned_slots(q_heads, kv_heads, window,
                                                                            kernel_options):
    """The C++ decode kernel (a quantized CPU model's decode steps) on ragged contexts over a NaN-poisoned
    cache; a plan that asks for it on a batch with prompt rows keeps the torch path."""
    from dsinfer.ops.attention import AttentionPlan, decode_attention_cpu

    kernel_options(use_triton="never")  # the CPU production path, as an engine on CPU runs it

    q, cache, tables, starts, lens = _batch(*LAYOUTS["decode"], q_heads, kv_heads, 64, 16, torch.float32, "cpu")
    plan = AttentionPlan(tables, starts, lens, window, 16, native_decode=True)
    out = paged_attention(q, cache, tables, starts, lens, 0.125, window, plan=plan)
    ref = _reference(q, cache, tables, starts, lens, 0.125, window)
    assert not out.isnan().any()  # the torch path reads the NaN padding: this is the C++ kernel's answer
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 99 is outside 1\.\.64"):
        decode_attention_cpu(q, cache, plan.layout.decode_slots, torch.tensor([1, 99, 40, 64, 33]), 0.125)
    q, cache, tables, starts, lens = _batch(*LAYOUTS["mixed"], q_heads, kv_heads, 64, 16, torch.float32, "cpu")
    plan = AttentionPlan(tables, starts, lens, window, 16, native_decode=True)
    torch.testing.assert_close(paged_attention(q, cache, tables, starts, lens, 0.125, window, plan=plan),
                               paged_attention_ref(q, cache, tables, starts, lens, 0.125, window),
                               rtol=0, atol=0, equal_nan=True)  # the same path, bit for bit
