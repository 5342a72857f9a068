"""MLA torch references: absorbed decode and expanded prefill over a paged latent cache vs dense attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.mla import mla_decode_ref, mla_prefill_ref, store_mla_kv, store_mla_kv_ref

H, N, P, V, R, BLOCK = 4, 16, 8, 12, 32, 4


def _dense_attention(q_nope, q_pe, latent, k_pe, w_kv_b, scale, first_pos):
    """Per-head K/V expanded from the latent; queries at positions first_pos.. attend causally."""
    kv = (latent @ w_kv_b.reshape(-1, R).T).view(-1, H, N + V)
    k = torch.cat((kv[..., :N], k_pe.unsqueeze(1).expand(-1, H, P)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length) <= (torch.arange(n) + first_pos).unsqueeze(1)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), kv[..., N:].transpose(0, 1), attn_mask=mask, scale=scale
    ).transpose(0, 1)


def test_absorbed_decode_and_expanded_prefill_match_dense_attention():
    gen = torch.Generator().manual_seed(0)
    seq_lens, q_lens = (
        [9, 1, 14, 6],
        [1, 1, 5, 6],
    )  # decode, decode (first token), prefill after a prefix, prefill
    num_blocks = 16
    tables = torch.randperm(num_blocks, generator=gen)[:16].view(4, 4).int()  # scattered blocks
    cache = torch.zeros(num_blocks, BLOCK, R + P)
    w_kv_b = torch.randn(H, N + V, R, generator=gen) / R**0.5
    latents = [torch.randn(n, R, generator=gen) for n in seq_lens]
    k_pes = [torch.randn(n, P, generator=gen) for n in seq_lens]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        store_mla_kv_ref(latents[b], k_pes[b], cache, slots)
    store_mla_kv_ref(torch.ones(1, R), torch.ones(1, P), cache, torch.tensor([-1]))  # padding: not stored
    total = sum(q_lens)
    q_nope, q_pe = torch.randn(total, H, N, generator=gen), torch.randn(total, H, P, generator=gen)
    cu = torch.tensor([0, 1, 2, 7, 13], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = 0.3
    ref = torch.cat(
        [
            _dense_attention(
                q_nope[cu[b] : cu[b + 1]],
                q_pe[cu[b] : cu[b + 1]],
                latents[b],
                k_pes[b],
                w_kv_b,
                scale,
                seq_lens[b] - q_lens[b],
            )
            for b in range(4)
        ]
    )
    prefill = mla_prefill_ref(q_nope, q_pe, cache, tables, cu, lens, w_kv_b, scale)
    torch.testing.assert_close(prefill, ref, rtol=1e-5, atol=1e-5)
    q_absorbed = torch.einsum("thn,hnr->thr", q_nope, w_kv_b[:, :N])
    latent_out = mla_decode_ref(q_absorbed, q_pe, cache, tables, cu, lens, scale)
    absorbed = torch.einsum("thr,hvr->thv", latent_out, w_kv_b[:, N:])
    torch.testing.assert_close(absorbed, ref, rtol=1e-4, atol=1e-5)


def test_store_skips_negative_slots(device):
    cache = torch.zeros(2, BLOCK, R + P, device=device)
    slots = torch.tensor([5, -1, 0], device=device)
    store_mla_kv(torch.ones(3, R, device=device), torch.full((3, P), 2.0, device=device), cache, slots)
    flat = cache.view(-1, R + P).cpu()
    assert flat[5, 0] == 1 and flat[5, -1] == 2 and flat[0, 0] == 1
    assert flat[[1, 2, 3, 4, 6, 7]].abs().sum() == 0
