"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token instead of one.

Before each attention / MoE block, weights computed from the streams collapse them into the block's input (``pre``)
and say how the block's output is spread back over the streams (``post``) and how the streams mix (``comb``,
projected onto the doubly-stochastic matrices by Sinkhorn-Knopp, so the mixing cannot grow the residual's norm).
The weights are a one-layer perceptron over the RMS-normalized, flattened streams, in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _init_like_transformers(base: nn.Parameter, scale: nn.Parameter) -> None:
    """Dummy weights as transformers initialises them: biases 0, scales 1 (``fn`` takes the normal init)."""
    base.dummy_init = lambda std, gen: base.data.zero_()
    scale.dummy_init = lambda std, gen: scale.data.fill_(1.0)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """Streams [T, N, D] -> (post [T, N], comb [T, N, N], the block input [T, D]); ``merge`` finishes the block."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult  # pre (N), post (N), comb (N x N)
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        _init_like_transformers(self.base, self.scale)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """New streams [T, N, D]: stream k gets post_k * block_out + sum_j comb[j, k] * stream j (comb is read
        transposed: Sinkhorn's result is doubly stochastic but not symmetric)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalizations of positive [.., N, N] matrices: columns first, then
    ``iters - 1`` (row, column) rounds, as the V4 reference does."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state per token (before the model's norm)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        _init_like_transformers(self.base, self.scale)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
