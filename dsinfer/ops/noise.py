"""Counter-based sampling noise keyed by (seed, position): the same request draws the same noise in any batch.

Every value is a pure function of (seed, position, token id), computed with 32-bit integer hashing that the Triton
sampler reproduces bit for bit, so a seeded request samples the same tokens alone, in any batch, on CPU or GPU.

    key(seed, pos)      = h(seed_lo ^ h(seed_hi ^ h(pos ^ 0x9E3779B9)))
    bits(seed, pos, i)  = h(key ^ h(i + 0x632BE5AB))
    u                   = ((bits >> 9) + 0.5) / 2**23            # in (0, 1), exact in float32
    gumbel              = -log(-log(u))

    accept(seed, pos)   = ((h(h(key) ^ 0x2545F491) >> 9) + 0.5) / 2**23   # speculative rejection's coin

with h the "lowbias32" integer hash (x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16).
Sampling is then ``argmax(logits / T + gumbel)`` over the allowed tokens (the Gumbel-max trick).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 over int64 tensors holding uint32 values (products wrap; the low 32 bits stay exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from int64 seeds and positions (both [B])."""
    seeds = seeds.long()
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    return hash32(lo ^ hash32(hi ^ hash32((positions.long() & _MASK32) ^ 0x9E3779B9)))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    keys = row_keys(seeds, positions).unsqueeze(1)
    token_hash = hash32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) + 0x632BE5AB)
    bits = hash32(keys ^ token_hash)
    return ((bits >> 9).float() + 0.5) * (1.0 / 2**23)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab_size)))


def acceptance_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] float32 uniforms in (0, 1) keyed by (seed, position), independent of the token noise of that position
    (a different composition of the hash): the coin that keeps or rejects a draft token in rejection sampling."""
    bits = hash32(hash32(row_keys(seeds, positions)) ^ 0x2545F491)
    return ((bits >> 9).float() + 0.5) * (1.0 / 2**23)
