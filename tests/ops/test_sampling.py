from __future__ import annotations

import pytest
import torch

from dsinfer.ops import gumbel_argmax
from dsinfer.ops.noise import uniform_noise
from dsinfer.ops.sampling import gumbel_argmax_ref


def _inputs(rows: int, vocab: int, device, temperature: float = 0.8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(device)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen).to(device)
    positions = torch.randint(0, 2**40, (rows,), generator=gen).to(device)
    temp = torch.full((rows,), temperature).to(device)
    return logits, seeds, positions, temp


@pytest.mark.parametrize("vocab", [7, 1000, 5000])
def test_sampled_tokens_equal_reference(vocab, device, poisoned):
    logits, seeds, positions, temp = _inputs(9, vocab, device, seed=vocab)
    temp[::3] = 1.7
    out = gumbel_argmax(logits, seeds, positions, temp)
    assert out.dtype == torch.int64
    assert torch.equal(out, gumbel_argmax_ref(logits, seeds, positions, temp))


def test_temperature_zero_rows_are_greedy_in_a_mixed_batch(device):
    logits, seeds, positions, temp = _inputs(8, 3000, device, seed=1)
    temp[1::2] = 0.0
    out = gumbel_argmax(logits, seeds, positions, temp)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))
    assert torch.equal(out, gumbel_argmax_ref(logits, seeds, positions, temp))


def test_noise_bits_are_exact_the_uniform_argmax_wins_with_flat_logits(device):
    # With equal logits and T = 1 the pick is argmax of the uniforms: a pure function of the integer hash.
    _, seeds, positions, temp = _inputs(6, 1, device, temperature=1.0, seed=2)
    logits = torch.zeros(6, 4099, device=device)
    out = gumbel_argmax(logits, seeds, positions, temp)
    assert torch.equal(out.cpu(), uniform_noise(seeds.cpu(), positions.cpu(), 4099).argmax(-1))


def test_masked_tokens_are_never_picked(device):
    logits, seeds, positions, temp = _inputs(16, 2500, device, temperature=50.0, seed=3)
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[:, 2100:2103] = True
    allowed[:, 5] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    temp[0] = 0.0
    out = gumbel_argmax(logits, seeds, positions, temp)
    assert bool(allowed.gather(1, out[:, None]).all())
    assert torch.equal(out, gumbel_argmax_ref(logits, seeds, positions, temp))


def test_a_row_draws_the_same_token_alone_or_in_a_batch(device):
    logits, seeds, positions, temp = _inputs(5, 1500, device, seed=4)
    batched = gumbel_argmax(logits, seeds, positions, temp)
    for i in (0, 3):
        alone = gumbel_argmax(logits[i : i + 1], seeds[i : i + 1], positions[i : i + 1], temp[i : i + 1])
        assert int(alone) == int(batched[i])


def test_ties_go_to_the_lowest_token_id(device):
    logits = torch.zeros(2, 3000, device=device)
    logits[:, [17, 2049, 2999]] = 5.0  # equal maxima in different vocab tiles
    temp = torch.zeros(2, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    out = gumbel_argmax(logits, seeds, seeds, temp)
    assert out.tolist() == [17, 17]


@pytest.mark.parametrize("num_chunks", [1, 2, 3])
def test_vocab_chunks_reduce_to_the_same_tokens(num_chunks, device, poisoned):
    from dsinfer.ops.triton.sampling import gumbel_argmax_triton

    logits, seeds, positions, temp = _inputs(4, 6200, device, seed=5)
    temp[2] = 0.0
    logits[3] = float("-inf")  # a fully masked row still gives token 0, as torch.argmax
    out = gumbel_argmax_triton(logits, seeds, positions, temp, num_chunks=num_chunks)
    assert torch.equal(out, gumbel_argmax_ref(logits, seeds, positions, temp))
    assert int(out[3]) == 0


def test_peaked_logits_match_reference(device):
    # Like a trained model's logits: a few tokens far above the rest.
    gen = torch.Generator().manual_seed(6)
    logits = 2 * torch.randn(32, 6000, generator=gen)
    hot = torch.randint(0, 6000, (32, 3), generator=gen)
    logits.scatter_(1, hot, 30 + torch.rand(32, 3, generator=gen))
    seeds = torch.arange(32, dtype=torch.int64) * 7919
    positions = torch.arange(32, dtype=torch.int64) + 100
    temp = torch.rand(32, generator=gen) + 0.3
    args = [t.to(device) for t in (logits, seeds, positions, temp)]
    out = gumbel_argmax(*args)
    assert torch.equal(out, gumbel_argmax_ref(*args))
    assert bool((out.cpu()[:, None] == hot).any(1).all())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_llama_vocab_tokens_equal_reference_on_gpu(rows):
    logits, seeds, positions, temp = _inputs(rows, 128256, "cuda", seed=rows)
    temp[::4] = 0.0
    out = gumbel_argmax(logits, seeds, positions, temp)
    ref = gumbel_argmax_ref(logits, seeds, positions, temp)
    assert torch.equal(out, ref)


# ---- greedy_argmax: batches greedy throughout ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_chunks", [None, 1, 3, 7])
def test_greedy_argmax_is_torch_argmax(dtype, num_chunks, device, poisoned):
    from dsinfer.ops.triton.sampling import argmax_triton

    gen = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(5, 6200, generator=gen)).to(dtype)
    logits[1, [40, 2100, 6199]] = 50.0  # equal maxima in different tiles and chunks: the first wins
    logits[2] = float("-inf")  # a fully masked row: token 0, as torch.argmax
    logits[3, :4000] = float("-inf")  # the maximum in the last chunk
    logits = logits.to(device)
    out = argmax_triton(logits, num_chunks=num_chunks)
    assert out.dtype == torch.int64
    assert torch.equal(out.cpu(), logits.cpu().float().argmax(-1))
    assert out.tolist()[1:3] == [40, 0]


def test_greedy_argmax_op_dispatches_and_takes_strided_rows(device):
    from dsinfer.ops import greedy_argmax

    gen = torch.Generator().manual_seed(8)
    padded = torch.randn(6, 3001, generator=gen).to(device)
    logits = padded[::2, :3000]  # rows of a larger buffer, as a decode graph's logits slice
    assert torch.equal(greedy_argmax(logits).cpu(), logits.cpu().argmax(-1))
    assert greedy_argmax(torch.empty(0, 10, device=device)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 256])
@pytest.mark.parametrize("vocab", [102400, 128256])
def test_greedy_argmax_at_real_vocabs_on_gpu(rows, vocab):
    from dsinfer.ops import greedy_argmax

    logits = torch.randn(rows, vocab, device="cuda").bfloat16()  # bf16: many exact ties, the first must win
    assert torch.equal(greedy_argmax(logits), logits.argmax(-1))
