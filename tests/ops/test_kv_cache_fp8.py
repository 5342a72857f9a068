"""FP8 KV cache (vLLM's kv_cache_dtype="fp8"): the store kernels and paged attention against their torch references.

Triton's CPU interpreter rounds float -> FP8 its own way, so the interpreter cases store values that are already on
the FP8 grid (times a power-of-two scale: the division is exact and every rounding mode agrees); the GPU cases store
arbitrary values and allow one unit in the last place.
"""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops import paged_attention, rotary_store_kv, store_kv
from dsinfer.ops.attention import paged_attention_ref
from dsinfer.ops.kv_cache import dequantize, quantize, store_kv_ref
from dsinfer.ops.rotary import rotary_store_kv_ref
from tests.ops.test_attention import LAYOUTS, _batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HAS_CUDA = torch.cuda.is_available()


def _on_grid(shape, dtype, scale, gen, magnitude=4.0):
    """Values that an FP8 cache of ``dtype`` holds exactly after division by ``scale`` (a power of two)."""
    return (torch.randn(shape, generator=gen) * magnitude).to(dtype).float() * scale


def _slots(num_tokens, num_blocks, block_size, gen, skip_every=0):
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    return slots


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 4.0)])
def test_store_kv_fp8_matches_reference(cache_dtype, scales, device):
    gen = torch.Generator().manual_seed(3)
    k = _on_grid((21, 2, 32), cache_dtype, scales[0], gen).to(device)
    v = _on_grid((21, 2, 32), cache_dtype, scales[1], gen).to(device)
    slots = _slots(21, 4, 16, gen, skip_every=5).to(device)
    cache = torch.zeros(2, 4, 16, 2, 32, dtype=cache_dtype, device=device)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots, scales)
    store_kv(k, v, cache, slots, scales)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    kept = slots >= 0
    flat = expected.view(2, -1, 2, 32)
    assert torch.equal(dequantize(flat[0][slots[kept]], scales[0], torch.float32), k[kept].float())
    assert torch.equal(dequantize(flat[1][slots[kept]], scales[1], torch.float32), v[kept].float())


def test_quantize_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 3.0, float("inf")])
    for dtype in FP8:
        out = quantize(x, 2.0, dtype).float()
        limit = torch.finfo(dtype).max
        assert out.tolist() == [limit, -limit, 1.5, limit]


def test_scales_apply_to_fp8_caches_only():
    x = torch.tensor([3.0, -5.0])
    assert torch.equal(quantize(x, 2.0, torch.bfloat16).float(), x)
    assert torch.equal(dequantize(x.bfloat16(), 2.0, torch.float32), x)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_rotary_store_kv_fp8_matches_reference(cache_dtype, device, assert_close):
    gen = torch.Generator().manual_seed(5)
    num_tokens, scales = 13, (2.0, 0.25)
    q = torch.randn(num_tokens, 4, 32, generator=gen).to(device)
    k = _on_grid((num_tokens, 2, 32), cache_dtype, scales[0], gen).to(device)
    v = _on_grid((num_tokens, 2, 32), cache_dtype, scales[1], gen).to(device)
    # position 0 rotates by nothing, so k reaches the cache unchanged (on the grid) in the interpreter too
    positions = (torch.randint(0, 64, (num_tokens,), generator=gen) if HAS_CUDA
                 else torch.zeros(num_tokens, dtype=torch.long)).to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(device)
    slots = _slots(num_tokens, 3, 16, gen, skip_every=4).to(device)
    cache = torch.zeros(2, 3, 16, 2, 32, dtype=cache_dtype, device=device)
    expected = cache.clone()
    q_ref = rotary_store_kv_ref(positions, q, k, v, cos_sin, True, expected, slots, scales)
    q_out = rotary_store_kv(positions, q, k, v, cos_sin, True, cache, slots, scales)
    assert_close(q_out, q_ref, torch.float32)
    if HAS_CUDA:  # arbitrary rotated values: the two roundings may differ by one unit in the last place
        assert_close(cache.float(), expected.float(), torch.bfloat16, tol=0.07)
    else:
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def _fp8_batch(layout, cache_dtype, scales, device, q_heads=8, kv_heads=2, head_dim=32, block_size=16):
    q_lens, ctx_lens = LAYOUTS[layout]
    q, cache, block_tables, qsl, seq_lens = _batch(q_lens, ctx_lens, q_heads, kv_heads, head_dim, block_size,
                                                   torch.float32, "cpu", seed=len(layout))
    cache = torch.nan_to_num(cache, nan=0.0)
    fp8 = torch.stack((quantize(cache[0], scales[0], cache_dtype), quantize(cache[1], scales[1], cache_dtype)))
    q = q.to(torch.bfloat16)
    return [t.to(device) for t in (q, fp8, block_tables, qsl, seq_lens)], max(q_lens)


@pytest.mark.parametrize("layout", ["decode", "prefill", "mixed", "prefix"])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_paged_attention_over_fp8_cache(layout, cache_dtype, device, assert_close):
    scales = (0.5, 2.0)
    (q, cache, block_tables, qsl, seq_lens), max_q = _fp8_batch(layout, cache_dtype, scales, device)
    scale = 32 ** -0.5
    out = paged_attention(q, cache, block_tables, qsl, seq_lens, scale, max_query_len=max_q, kv_scales=scales)
    # the reference dequantizes explicitly: the same attention as a bf16/float32 cache holding k * k_scale
    deq = torch.stack((dequantize(cache[0].cpu(), scales[0], torch.float32),
                       dequantize(cache[1].cpu(), scales[1], torch.float32)))
    ref = paged_attention_ref(q.float().cpu(), deq, block_tables.cpu(), qsl.cpu(), seq_lens.cpu(), scale)
    assert_close(out.float(), ref, torch.bfloat16)
    via_ref = paged_attention_ref(q, cache, block_tables, qsl, seq_lens, scale, kv_scales=scales)
    assert_close(via_ref.float(), ref, torch.bfloat16)


@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_invariant_attention_over_fp8_cache(layout, device, assert_close):
    from dsinfer.batch_invariant.attention import paged_attention_invariant

    scales = (0.25, 0.5)
    (q, cache, block_tables, qsl, seq_lens), _ = _fp8_batch(layout, torch.float8_e4m3fn, scales, device)
    out = paged_attention_invariant(q, cache, block_tables, qsl, seq_lens, 32 ** -0.5, None, scales)
    ref = paged_attention_ref(q.cpu(), cache.cpu(), block_tables.cpu(), qsl.cpu(), seq_lens.cpu(), 32 ** -0.5,
                              kv_scales=scales)
    assert_close(out.float(), ref.float(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_store_kv_fp8_llama_heads_on_gpu(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    k = (torch.randn(num_tokens, 8, 128, generator=gen) * 300).bfloat16().cuda()  # some values saturate
    v = torch.randn(num_tokens, 8, 128, generator=gen).bfloat16().cuda()
    slots = _slots(num_tokens, 1024, 16, gen, skip_every=7).cuda()
    cache = torch.zeros(2, 1024, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots, (1.0, 0.5))
    store_kv(k, v, cache, slots, (1.0, 0.5))
    assert not cache.float().isnan().any()
    diff = (cache.float() - expected.float()).abs()
    assert float((diff / expected.float().abs().clamp_min(2 ** -6)).max()) <= 0.13  # at most one e4m3 step


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("batch,ctx", [(1, 1024), (64, 1000), (256, 1024)])
def test_paged_attention_decode_fp8_at_llama_shape(batch, ctx, cache_dtype, assert_close):
    """Both tile configs (32 keys at batch 1, 128 keys from 64 sequences x heads on), a context that ends inside a
    tile, and both FP8 formats through the in-register value conversion."""
    gen = torch.Generator("cuda").manual_seed(batch)
    blocks_per_seq = -(-ctx // 16)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(2, num_blocks, 16, 8, 128, generator=gen, device="cuda").to(cache_dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, blocks_per_seq).int()
    q = torch.randn(batch, 32, 128, generator=gen, device="cuda").bfloat16()
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = paged_attention(q, cache, block_tables, qsl, seq_lens, 128 ** -0.5, max_query_len=1, max_seq_len=ctx)
    ref = paged_attention_ref(q.float(), cache.float(), block_tables, qsl, seq_lens, 128 ** -0.5)
    assert_close(out.float(), ref, torch.bfloat16)
