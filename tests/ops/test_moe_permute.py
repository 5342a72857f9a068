"""Activations copied into the fused MoE's expert order (``ops.triton.moe_permute``) vs gathering and quantizing
them in torch."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("quant", [False, True])
def test_permute_rows_gathers_pairs_in_aligned_order(quant, device, poisoned):
    from dsinfer.ops.triton.fp8 import per_token_group_quant
    from dsinfer.ops.triton.moe_align import moe_align
    from dsinfer.ops.triton.moe_permute import permute_rows

    gen = torch.Generator().manual_seed(3)
    num_tokens, hidden, top_k, num_experts, block_m = 7, 80, 2, 5, 4
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).bfloat16().to(device)
    x[2] = 0  # a zero row: scale 0 in every group
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(device)
    align = moe_align(ids, num_experts, block_m)
    rows, scales = permute_rows(x, align, a_div=top_k, group=32 if quant else None)
    sorted_ids, num_padded = align[0].long().cpu(), int(align[2])
    pairs = sorted_ids[:num_padded]
    valid = pairs < num_tokens * top_k
    assert rows.shape == (sorted_ids.numel(), hidden) and num_padded % block_m == 0
    expect = torch.zeros(num_padded, hidden, dtype=x.dtype)
    expect[valid] = x.cpu()[pairs[valid] // top_k]
    if not quant:
        assert scales is None and torch.equal(rows[:num_padded].cpu(), expect)
        return
    q_ref, s_ref = per_token_group_quant(expect.to(device), 32)  # 80 columns: the last group is partial
    assert scales.shape == (sorted_ids.numel(), 3) and scales.stride() == (1, sorted_ids.numel())
    assert torch.equal(rows[:num_padded].float(), q_ref.float())
    assert torch.equal(scales[:num_padded], s_ref)
    again, again_s = permute_rows(rows[:num_padded].float() * scales[:num_padded].repeat_interleave(32, 1)[:, :80],
                                  align, gather=False, group=32)  # already in order: row r is x[r]
    assert torch.equal(again[:num_padded].float(), q_ref.float())
