"""An FP8 MLA latent cache (``kv_cache_dtype="fp8"`` on DeepSeek): the writes saturate and match the torch
reference byte for byte, and every reader (absorbed decode through pointer loads and through TMA, expanded prefill
over a cached prefix) attends over the FP8 rows as the reference does over the same values widened."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.kv_cache import fp8_max
from dsinfer.ops.mla import (
    cache_rows,
    mla_decode_ref,
    mla_prefill,
    mla_prefill_ref,
    store_mla_kv,
    store_mla_kv_ref,
)
from tests.ops.test_mla_triton import _clean, _latent_batch, rope_norm_store_case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_cache(q_lens, ctx_lens, heads, rank, rope, block_size, fp8, device):
    """``_latent_batch``'s cache (NaN where no sequence owns a row) in ``fp8``, plus the rest of the batch."""
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, heads, rank, rope, block_size,
                                                      torch.float32, device)
    limit = fp8_max(fp8)
    return (cache * 3).clamp(-limit, limit).to(fp8), tables, qsl, seq_lens, gen  # NaN rows stay NaN


@pytest.mark.parametrize("fp8", FP8, ids=lambda d: str(d)[-6:])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
def test_mla_decode_over_fp8_cache(fp8, q_dtype, tma, device, poisoned, assert_close):
    from dsinfer.ops.triton.mla import mla_decode_triton

    # rank 32, rope 16: TMA takes whole 16-row tiles of the 32-row blocks, the masked loads the rest;
    # three rows of the first sequence are draft rows (causal), three splits cut at tile boundaries
    q_lens, ctx_lens, heads, rank, rope = [3, 1, 1], [45, 17, 80], 4, 32, 16
    cache, tables, qsl, seq_lens, gen = _fp8_cache(q_lens, ctx_lens, heads, rank, rope, 32, fp8, device)
    assert cache.element_size() == 1
    q_nope = torch.randn(sum(q_lens), heads, rank, generator=gen).to(q_dtype).to(device)
    q_pe = torch.randn(sum(q_lens), heads, rope, generator=gen).to(q_dtype).to(device)
    cfg = dict(block_h=16, block_n=16, num_warps=4, num_stages=2, tma=tma)
    out = mla_decode_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.3, num_splits=3, config=cfg)
    assert out.dtype == q_dtype
    ref = mla_decode_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                         seq_lens.cpu(), 0.3)
    assert_close(out, ref, q_dtype)


@pytest.mark.parametrize("fp8", FP8, ids=lambda d: str(d)[-6:])
def test_mla_decode_ref_reads_fp8_in_the_query_dtype(fp8):
    """The torch path over an FP8 cache computes in the query's dtype, equal to the widened cache's result."""
    cache, tables, qsl, seq_lens, gen = _fp8_cache([1, 1], [20, 9], 4, 16, 8, 8, fp8, "cpu")
    cache = torch.nan_to_num(cache.float()).to(fp8)  # the reference takes whole padded rows: no NaN
    q_nope, q_pe = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 4, 8, generator=gen)
    out = mla_decode_ref(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.25)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, mla_decode_ref(q_nope, q_pe, cache.float(), tables, qsl, seq_lens, 0.25))


@pytest.mark.parametrize("fp8", FP8, ids=lambda d: str(d)[-6:])
def test_mla_prefill_over_fp8_cache_with_cached_prefix(fp8, device, poisoned, assert_close):
    heads, nope, vdim, rank, rope = 3, 16, 16, 32, 16
    q_lens, ctx_lens = [5, 20, 7], [37, 20, 7]  # a cached prefix, then whole prompts
    cache, tables, qsl, seq_lens, gen = _fp8_cache(q_lens, ctx_lens, heads, rank, rope, 16, fp8, device)
    q_nope = torch.randn(sum(q_lens), heads, nope, generator=gen).bfloat16().to(device)
    q_pe = torch.randn(sum(q_lens), heads, rope, generator=gen).bfloat16().to(device)
    w_kv_b = (torch.randn(heads, nope + vdim, rank, generator=gen) / rank**0.5).bfloat16().to(device)
    out = mla_prefill(q_nope, q_pe, cache, tables, qsl, seq_lens, w_kv_b, 0.2)
    ref = mla_prefill_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                          seq_lens.cpu(), w_kv_b.double().cpu(), 0.2)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("fp8", FP8, ids=lambda d: str(d)[-6:])
def test_fp8_latent_stores_saturate_and_match_the_reference(fp8, device):
    # values on the FP8 grid (Triton's CPU interpreter rounds to FP8 its own way), and two past the format's
    # range: saturated, not NaN / inf
    limit = fp8_max(fp8)
    gen = torch.Generator().manual_seed(2)
    kv_c = (torch.randn(5, 32, generator=gen) * 4).to(fp8).float().to(device)[:, :16]  # strided, as after a split
    kv_c[0, 0], kv_c[2, 3] = 1e6, -1e6
    k_pe = torch.randn(5, 8, generator=gen).to(fp8).float().to(device)
    slots = torch.tensor([7, -1, 0, 11, 2], device=device)
    cache = torch.zeros(3, 4, 24, dtype=fp8, device=device)
    cache_ref = torch.zeros(3, 4, 24, dtype=fp8)
    store_mla_kv(kv_c, k_pe, cache, slots)
    store_mla_kv_ref(kv_c.cpu(), k_pe.cpu(), cache_ref, slots.cpu())
    assert torch.equal(cache.cpu().view(torch.uint8), cache_ref.view(torch.uint8))
    rows = cache_rows(cache, slots.clamp_min(0)).float().cpu()
    assert rows[0, 0] == limit and rows[2, 3] == -limit
    assert cache.cpu().view(-1, 24)[1].float().abs().sum() == 0  # the padded token wrote nothing


@pytest.mark.gpu  # Triton's CPU interpreter drops the carry of a rounding into the next binade (1.97 -> 1.0)
@pytest.mark.parametrize("fp8", FP8, ids=lambda d: str(d)[-6:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_norm_store_into_fp8_cache(fp8, dtype, device, poisoned):
    _, _, cache, cache_ref = rope_norm_store_case(dtype, fp8, True, device, seed=5, kv_scale=3.0)
    # within one FP8 step (3 mantissa bits in e4m3, 2 in e5m2): the kernel and the reference round float32 values
    # that may differ in their last bits
    step = 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2)
    torch.testing.assert_close(cache.cpu().float(), cache_ref.float(), rtol=step, atol=1e-3)


def test_fp8_cache_takes_its_own_decode_tile_where_the_table_has_one(monkeypatch):
    """``decode_config``: an FP8 cache picks ``"<heads>,fp8"`` when tuned, else the head count's tile; a bf16
    cache never picks the FP8 entry."""
    from dsinfer.ops.triton import mla

    table = {"128": dict(block_h=64, tma=True), "128,fp8": dict(block_h=64, tma=False), "16": dict(block_h=16)}
    monkeypatch.setattr(mla, "_decode_configs", lambda: table)
    assert mla.decode_config(128, True, fp8_cache=True) == table["128,fp8"]
    assert mla.decode_config(128, True) == table["128"]
    assert mla.decode_config(16, True, fp8_cache=True) == table["16"]
    assert mla.decode_config(16, False, fp8_cache=True)["num_stages"] == 1  # the interpreter's own tile
    chosen = mla.decode_config(128, True, fp8_cache=True)
    chosen["tma"] = True  # a copy: the caller may edit it
    assert table["128,fp8"]["tma"] is False
