"""Triton MLA kernels (latent store, absorbed decode, expanded prefill) against the torch references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dsinfer.ops.mla import (
    mla_decode,
    mla_decode_ref,
    mla_decode_uv,
    mla_decode_uv_ref,
    mla_prefill,
    mla_prefill_ref,
    rope_norm_store_mla,
    store_mla_kv,
    store_mla_kv_ref,
)
from dsinfer.ops.norm import rms_norm_ref
from dsinfer.ops.rotary import apply_rotary_ref


def _latent_batch(q_lens, ctx_lens, heads, rank, rope, block_size, dtype, device, seed=0):
    """A paged latent cache over shuffled blocks; rows no sequence owns are NaN (a kernel reading one shows)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / block_size) for n in ctx_lens]
    num_blocks = sum(per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen)
    width = max(per_seq) + 1
    tables = torch.full((len(ctx_lens), width), int(order[-1]), dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan"))
    used = 0
    for b, n in enumerate(ctx_lens):
        ids = order[used : used + per_seq[b]]
        used += per_seq[b]
        tables[b, : len(ids)] = ids.int()
        pos = torch.arange(n)
        cache[ids[pos // block_size], pos % block_size] = torch.randn(n, rank + rope, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = dict(device=device)
    return (cache.to(dtype).to(**to), tables.to(**to), qsl.to(**to),
            torch.tensor(ctx_lens, dtype=torch.int32, device=device), gen)


def _clean(cache):
    return torch.nan_to_num(cache.double().cpu(), nan=0.0)


DECODE_CASES = [
    # (q_lens, ctx_lens, heads, rank, rope, block_size, dtype, num_splits)
    ([1, 1, 1, 1], [1, 17, 40, 33], 4, 32, 16, 16, torch.float32, None),
    ([1, 1, 1], [50, 9, 64], 20, 32, 16, 8, torch.bfloat16, 3),  # two head tiles, three splits
    ([3, 1, 2], [20, 7, 33], 4, 16, 16, 16, torch.float32, 2),  # several rows per sequence (drafts)
    # the tiny DeepSeek parity models (rank 32, rope 8 < tl.dot's 16: padded, masked feature tiles)
    ([1, 1, 1, 1], [3, 16, 17, 64], 4, 32, 8, 16, torch.float32, None),
    ([3, 1, 2], [20, 7, 33], 4, 32, 8, 16, torch.float32, 3),  # drafts, three splits, block boundaries
    ([1, 1], [40, 9], 4, 32, 8, 16, torch.bfloat16, 2),
]


@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"q{max(c[0])}-h{c[2]}-r{c[3]}-p{c[4]}-{str(c[6])[6:]}-s{c[7]}")
def test_mla_decode_matches_reference(case, device, poisoned, assert_close):
    from dsinfer.ops.triton.mla import mla_decode_triton

    q_lens, ctx_lens, heads, rank, rope, block_size, dtype, splits = case
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, heads, rank, rope, block_size, dtype,
                                                      device)
    q_nope = torch.randn(sum(q_lens), heads, rank, generator=gen).to(dtype).to(device)
    q_pe = torch.randn(sum(q_lens), heads, rope, generator=gen).to(dtype).to(device)
    scale = 0.3
    out = mla_decode_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, scale, num_splits=splits)
    ref = mla_decode_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                         seq_lens.cpu(), scale)
    assert_close(out, ref, dtype)


def test_mla_decode_head_tile_wider_than_the_heads(device, poisoned, assert_close):
    """A config may pad the heads (4 here) to a wider tile (32): padding rows compute on zeros, store nothing;
    or re-read the query every key tile (``reload_q``)."""
    from dsinfer.ops.triton.mla import mla_decode_triton

    cache, tables, qsl, seq_lens, gen = _latent_batch([1, 1, 1], [30, 9, 47], 4, 32, 16, 16, torch.bfloat16,
                                                      device)
    q_nope = torch.randn(3, 4, 32, generator=gen).bfloat16().to(device)
    q_pe = torch.randn(3, 4, 16, generator=gen).bfloat16().to(device)
    base = dict(block_h=16, block_n=16, num_warps=4, num_stages=1)
    configs = [dict(base, block_h=32), dict(base, reload_q=True)]
    for cfg, splits in itertools.product(configs, (1, 2)):
        out = mla_decode_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.3, num_splits=splits, config=cfg)
        ref = mla_decode_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                             seq_lens.cpu(), 0.3)
        assert_close(out, ref, torch.bfloat16)


TMA_CASES = [
    # (q_lens, ctx_lens, heads, rank, rope, block_size, block_n, dtype, num_splits): full tiles by TMA, the
    # partial last tile of a split by masked loads (rows past the context are NaN in the cache)
    ([1, 1, 1], [64, 17, 100], 4, 32, 16, 32, 16, torch.float32, 1),
    ([3, 1, 2], [40, 7, 70], 4, 32, 8, 32, 16, torch.bfloat16, 3),  # drafts; rope 8 read as a 16-wide box
    ([1, 1], [96, 33], 20, 512, 16, 32, 16, torch.bfloat16, 2),  # rank 512: two latent chunks; two head tiles
]


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"r{c[3]}-p{c[4]}-{str(c[7])[6:]}-s{c[8]}")
def test_mla_decode_tma_matches_reference(case, device, poisoned, assert_close):
    from dsinfer.ops.triton.mla import mla_decode_triton
    from dsinfer.ops.triton.mla_tma import tma_chunks

    q_lens, ctx_lens, heads, rank, rope, block_size, block_n, dtype, splits = case
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, heads, rank, rope, block_size, dtype,
                                                      device)
    assert tma_chunks(rank, max(16, rope), cache, block_n) == (2 if rank == 512 else 1)
    q_nope = torch.randn(sum(q_lens), heads, rank, generator=gen).to(dtype).to(device)
    q_pe = torch.randn(sum(q_lens), heads, rope, generator=gen).to(dtype).to(device)
    cfg = dict(block_h=16, block_n=block_n, num_warps=4, num_stages=2, tma=True)
    out = mla_decode_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.3, num_splits=splits, config=cfg)
    ref = mla_decode_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                         seq_lens.cpu(), 0.3)
    assert_close(out, ref, dtype)


def test_mla_decode_tma_declines_shapes_it_cannot_serve():
    from dsinfer.ops.triton.mla_tma import tma_chunks

    cache = torch.zeros(4, 32, 40)
    assert tma_chunks(32, 16, cache, 16) == 1
    assert tma_chunks(24, 16, cache, 16) is None  # rank not a power of two
    assert tma_chunks(32, 16, cache, 64) is None  # a key tile would span two cache blocks
    assert tma_chunks(32, 16, torch.zeros(4, 32, 41)[..., :40], 16) is None  # rows not contiguous
    assert tma_chunks(1024, 64, torch.zeros(1, 16, 1088), 16) is None  # more than two 256-wide boxes


@pytest.mark.gpu
def test_mla_decode_tma_at_v2_lite_shapes_on_gpu(assert_close):
    """The tuned H=16 config (TMA) at V2-Lite's latent (512 + 64), 64-row blocks, against the pointer kernel."""
    from dsinfer.ops.triton.mla import decode_config, mla_decode_triton

    cache, tables, qsl, seq_lens, gen = _latent_batch([1] * 8, [1000, 1, 31, 64, 65, 4096, 300, 2047], 16, 512,
                                                      64, 64, torch.bfloat16, "cuda")
    q_nope = torch.randn(8, 16, 512, generator=gen).bfloat16().cuda()
    q_pe = torch.randn(8, 16, 64, generator=gen).bfloat16().cuda()
    cfg = decode_config(16, True)
    assert cfg.get("tma"), cfg
    for splits in (None, 1, 5):
        out = mla_decode_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.1, num_splits=splits, config=cfg)
        ref = mla_decode_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.1, num_splits=splits,
                                config=dict(cfg, tma=False))
        assert_close(out, ref, torch.bfloat16, tol=2e-3)


@pytest.mark.parametrize("rope", [16, 8])  # 8: the tiny parity models' rope dim takes the Triton path too
def test_mla_decode_skips_padding_rows_and_uses_public_op(rope, device, assert_close):
    cache, tables, qsl, seq_lens, gen = _latent_batch([1, 1], [5, 21], 4, 16, rope, 4, torch.float32, device)
    q_nope = torch.randn(3, 4, 16, generator=gen).to(device)  # row 2 is graph padding: no sequence owns it
    q_pe = torch.randn(3, 4, rope, generator=gen).to(device)
    out = mla_decode(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.25, max_seq_len=21)
    ref = mla_decode_ref(q_nope[:2].double().cpu(), q_pe[:2].double().cpu(), _clean(cache), tables.cpu(),
                         qsl.cpu(), seq_lens.cpu(), 0.25)
    assert_close(out[:2], ref, torch.float32)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("rank,v_dim", [(32, 24), (160, 40)])  # 160: two latent slices, the second masked
def test_mla_decode_uv_matches_reference(rank, v_dim, num_splits, fused, device, assert_close):
    """Decode then W_UV: the one-kernel split combine + W_UV and the two-launch path, beside a graph padding
    row (row 3 belongs to no sequence); V not a multiple of the kernel's column tile."""
    from dsinfer.ops.triton.mla_uv import mla_decode_uv_triton

    heads, rope = 4, 16
    cache, tables, qsl, seq_lens, gen = _latent_batch([1, 1, 1], [5, 70, 33], heads, rank, rope, 16,
                                                      torch.float32, device)
    q_nope = torch.randn(4, heads, rank, generator=gen).to(device)
    q_pe = torch.randn(4, heads, rope, generator=gen).to(device)
    w_kv_b = torch.randn(heads, 16 + v_dim, rank, generator=gen).to(device) / rank**0.5
    w_uv = w_kv_b[:, 16:]  # a view with kv_b_proj's strides, as the layer passes it
    out = mla_decode_uv_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.25, w_uv, num_splits=num_splits,
                               fused=fused)
    ref = mla_decode_uv_ref(q_nope[:3].double().cpu(), q_pe[:3].double().cpu(), _clean(cache), tables.cpu(),
                            qsl.cpu(), seq_lens.cpu(), 0.25, w_uv.double().cpu())
    assert out.shape == (4, heads, v_dim)
    assert_close(out[:3], ref, torch.float32)


def test_mla_decode_uv_public_op_writes_into_out_and_checks_w_uv(device, assert_close):
    heads, rank, rope, v_dim = 4, 32, 16, 16
    cache, tables, qsl, seq_lens, gen = _latent_batch([1, 1], [9, 40], heads, rank, rope, 8, torch.float32,
                                                      device)
    q_nope = torch.randn(2, heads, rank, generator=gen).to(device)
    q_pe = torch.randn(2, heads, rope, generator=gen).to(device)
    w_uv = torch.randn(heads, v_dim, rank, generator=gen).to(device)
    out = torch.full((2, heads, v_dim), float("nan"), device=device)
    got = mla_decode_uv(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.25, w_uv, out=out, max_seq_len=40)
    assert got.data_ptr() == out.data_ptr()
    ref = mla_decode_uv_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                            seq_lens.cpu(), 0.25, w_uv.double().cpu())
    assert_close(out, ref, torch.float32)
    from dsinfer.ops.triton.mla_uv import mla_decode_uv_triton

    with pytest.raises(ValueError, match="w_uv must be"):
        mla_decode_uv_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.25, w_uv.transpose(1, 2))
    with pytest.raises(ValueError, match="out must be"):
        mla_decode_uv_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, 0.25, w_uv, out=out[:1])
    empty = mla_decode_uv_triton(q_nope[:0], q_pe[:0], cache, tables, qsl[:1], seq_lens[:0], 0.25, w_uv)
    assert empty.shape == (0, heads, v_dim)


@pytest.mark.parametrize("rope", [16, 8])  # 8: the tiny parity models (a padded, masked tl.dot operand)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_prefill_with_cached_prefix_matches_reference(dtype, rope, device, poisoned, assert_close):
    heads, nope, vdim, rank = 3, 16, 16, 32
    q_lens, ctx_lens = [5, 20, 1, 7], [37, 20, 9, 7]  # cached prefix, whole prompt, decode-like, prompt
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, heads, rank, rope, 16, dtype, device)
    q_nope = torch.randn(sum(q_lens), heads, nope, generator=gen).to(dtype).to(device)
    q_pe = torch.randn(sum(q_lens), heads, rope, generator=gen).to(dtype).to(device)
    w_kv_b = (torch.randn(heads, nope + vdim, rank, generator=gen) / rank**0.5).to(dtype).to(device)
    out = mla_prefill(q_nope, q_pe, cache, tables, qsl, seq_lens, w_kv_b, 0.2)
    ref = mla_prefill_ref(q_nope.double().cpu(), q_pe.double().cpu(), _clean(cache), tables.cpu(), qsl.cpu(),
                          seq_lens.cpu(), w_kv_b.double().cpu(), 0.2)
    assert_close(out, ref, dtype)


def test_store_mla_kv_writes_rows_and_skips_padding(device):
    cache = torch.zeros(3, 4, 24, device=device)
    cache_ref = cache.clone()
    kv_c = torch.randn(5, 32, device=device)[:, :16]  # strided rows, as after a split
    k_pe = torch.randn(5, 8, device=device)
    slots = torch.tensor([7, -1, 0, 11, 2], device=device)
    store_mla_kv(kv_c, k_pe, cache, slots)
    store_mla_kv_ref(kv_c, k_pe, cache_ref, slots)
    assert torch.equal(cache, cache_ref)
    assert cache.view(-1, 24)[1].abs().sum() == 0  # the padded token wrote nothing


def rope_norm_store_case(dtype, cache_dtype, is_neox, device, seed=3, kv_scale=1.0):
    """The fused rope / latent norm / store on 5 tokens (one of them padding) and the unfused torch reference:
    (q_out, q_ref, cache, cache_ref); the reference runs on CPU."""
    heads, nope, rope, rank, tokens = 3, 16, 8, 32, 5
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(dtype).to(device)
    q_pe = q[..., nope:]  # strided, as after the split
    kv = (torch.randn(tokens, rank + rope, generator=gen) * kv_scale).to(dtype).to(device)
    kv_c, k_pe = kv.split([rank, rope], dim=-1)
    weight = (1 + 0.1 * torch.randn(rank, generator=gen)).to(dtype).to(device)
    cos_sin = torch.randn(64, rope, generator=gen).to(device)
    positions = torch.tensor([3, 0, 63, 17, 5], device=device)
    slots = torch.tensor([7, -1, 0, 11, 2], device=device)
    cache = torch.zeros(3, 4, rank + rope, dtype=cache_dtype, device=device)
    cache_ref = torch.zeros(3, 4, rank + rope, dtype=cache_dtype)
    q_out = rope_norm_store_mla(positions, q_pe, k_pe, kv_c, weight, 1e-6, cos_sin, is_neox, cache, slots)
    cpu = [t.cpu() for t in (positions, q_pe, k_pe, kv_c, weight, cos_sin, slots)]
    q_ref, k_ref = apply_rotary_ref(cpu[0], cpu[1], cpu[2].unsqueeze(1), cpu[5], is_neox)
    store_mla_kv_ref(rms_norm_ref(cpu[3], cpu[4], 1e-6), k_ref.squeeze(1), cache_ref, cpu[6])
    assert cache.cpu().view(-1, rank + rope)[1].float().abs().sum() == 0  # the padded token wrote nothing
    return q_out, q_ref, cache, cache_ref


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_norm_store_matches_unfused_reference(dtype, is_neox, device, poisoned, assert_close):
    q_out, q_ref, cache, cache_ref = rope_norm_store_case(dtype, dtype, is_neox, device)
    assert q_out.dtype == dtype and q_out.is_contiguous()
    assert_close(q_out, q_ref, dtype)
    assert_close(cache, cache_ref, dtype)


@pytest.mark.parametrize("chunk", [128, 16])  # one W_UK chunk per head, two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_norm_store_absorbs_the_query(dtype, chunk, device, poisoned, assert_close, monkeypatch):
    """With ``absorb`` the same launch also writes q_nope @ W_UK per head (W_UK a strided view of kv_b's weight,
    q_nope a strided slice of q, as in the layer); rope, norm and store are unchanged."""
    from dsinfer.ops import mla
    from dsinfer.ops.triton import mla_cache

    monkeypatch.setattr(mla_cache, "ABSORB_CHUNK", chunk)
    heads, nope, rope, rank, value = 3, 16, 8, 32, 8
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(5, heads, nope + rope, generator=gen).to(dtype).to(device)
    w_kv_b = (torch.randn(heads, nope + value, rank, generator=gen) / nope**0.5).to(dtype).to(device)
    kv = torch.randn(5, rank + rope, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(rank, generator=gen)).to(dtype).to(device)
    cos_sin = torch.randn(64, rope, generator=gen).to(device)
    positions = torch.tensor([3, 0, 63, 17, 5], device=device)
    slots = torch.tensor([7, -1, 0, 11, 2], device=device)
    caches = [torch.zeros(3, 4, rank + rope, dtype=dtype, device=device) for _ in range(2)]
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    kv_c, k_pe = kv.split([rank, rope], dim=-1)
    w_uk = w_kv_b[:, :nope]
    q_abs, q_out = rope_norm_store_mla(positions, q_pe, k_pe, kv_c, weight, 1e-6, cos_sin, True, caches[0], slots,
                                       absorb=(q_nope, w_uk))
    q_plain = rope_norm_store_mla(positions, q_pe, k_pe, kv_c, weight, 1e-6, cos_sin, True, caches[1], slots)
    assert torch.equal(q_out, q_plain) and torch.equal(caches[0], caches[1])
    assert q_abs.shape == (5, heads, rank) and q_abs.dtype == dtype
    assert_close(q_abs, mla.absorb_query(q_nope.double().cpu(), w_uk.double().cpu()), dtype)
    with pytest.raises(ValueError, match="W_UK"):
        rope_norm_store_mla(positions, q_pe, k_pe, kv_c, weight, 1e-6, cos_sin, True, caches[0], slots,
                            absorb=(q_nope, w_uk.transpose(1, 2)))


# ---- GPU, real shapes ----

@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, V3
def test_mla_decode_real_shapes(heads, assert_close):
    batch, ctx = 32, 1000
    cache, tables, qsl, seq_lens, gen = _latent_batch(
        [1] * batch, [ctx - 29 * b for b in range(batch)][::-1], heads, 512, 64, 64, torch.bfloat16, "cuda"
    )
    q_nope = torch.randn(batch, heads, 512, generator=gen).bfloat16().cuda()
    q_pe = torch.randn(batch, heads, 64, generator=gen).bfloat16().cuda()
    scale = 192**-0.5
    out = mla_decode(q_nope, q_pe, cache, tables, qsl, seq_lens, scale, max_seq_len=ctx)
    ref = mla_decode_ref(q_nope.float(), q_pe.float(), torch.nan_to_num(cache.float()), tables, qsl, seq_lens,
                         scale)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, V3
@pytest.mark.parametrize("tokens", [1, 4])
def test_absorbing_preamble_real_shapes(heads, tokens, assert_close):
    from dsinfer.ops.mla import absorb_query

    nope, rope, rank, value = 128, 64, 512, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(tokens, heads, nope + rope, generator=gen, **bf)
    w_kv_b = torch.randn(heads, nope + value, rank, generator=gen, **bf) / nope**0.5
    kv = torch.randn(tokens, rank + rope, generator=gen, **bf)
    cache = torch.zeros(4, 64, rank + rope, **bf)
    positions = torch.arange(tokens, device="cuda") * 7
    slots = torch.arange(tokens, device="cuda") * 3
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_abs, _ = rope_norm_store_mla(positions, q_pe, kv[:, rope:], kv[:, :rank], torch.ones(rank, **bf), 1e-6,
                                   torch.randn(64, rope, generator=gen, device="cuda"), True, cache, slots,
                                   absorb=(q_nope, w_kv_b[:, :nope]))
    assert_close(q_abs, absorb_query(q_nope.float(), w_kv_b[:, :nope].float()), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, V3
@pytest.mark.parametrize("batch", [1, 4, 32])  # the default path, and both paths forced
def test_mla_decode_uv_real_shapes(heads, batch, assert_close):
    from dsinfer.ops.triton.mla_uv import mla_decode_uv_triton

    cache, tables, qsl, seq_lens, gen = _latent_batch(
        [1] * batch, [1000 - 29 * b for b in range(batch)][::-1], heads, 512, 64, 64, torch.bfloat16, "cuda"
    )
    q_nope = torch.randn(batch, heads, 512, generator=gen).bfloat16().cuda()
    q_pe = torch.randn(batch, heads, 64, generator=gen).bfloat16().cuda()
    w_uv = (torch.randn(heads, 128 + 128, 512, generator=gen) / 512**0.5).bfloat16().cuda()[:, 128:]
    scale = 192**-0.5
    ref = mla_decode_uv_ref(q_nope.float(), q_pe.float(), torch.nan_to_num(cache.float()), tables, qsl, seq_lens,
                            scale, w_uv.float())
    assert_close(mla_decode_uv(q_nope, q_pe, cache, tables, qsl, seq_lens, scale, w_uv, max_seq_len=1000), ref,
                 torch.bfloat16)
    for fused in (True, False):
        out = mla_decode_uv_triton(q_nope, q_pe, cache, tables, qsl, seq_lens, scale, w_uv, max_seq_len=1000,
                                   fused=fused)
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_mla_prefill_real_shapes(assert_close):
    heads, q_lens, ctx_lens = 16, [300, 77], [812, 77]
    cache, tables, qsl, seq_lens, gen = _latent_batch(q_lens, ctx_lens, heads, 512, 64, 64, torch.bfloat16,
                                                      "cuda")
    q_nope = torch.randn(sum(q_lens), heads, 128, generator=gen).bfloat16().cuda()
    q_pe = torch.randn(sum(q_lens), heads, 64, generator=gen).bfloat16().cuda()
    w_kv_b = (torch.randn(heads, 256, 512, generator=gen) / 512**0.5).bfloat16().cuda()
    out = mla_prefill(q_nope, q_pe, cache, tables, qsl, seq_lens, w_kv_b, 192**-0.5)
    ref = mla_prefill_ref(q_nope.float(), q_pe.float(), torch.nan_to_num(cache.float()), tables, qsl, seq_lens,
                          w_kv_b.float(), 192**-0.5)
    assert_close(out, ref, torch.bfloat16)
