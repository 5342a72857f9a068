"""V4's MoE block: routed experts chosen by a learned top-k or by a frozen token hash, plus one shared expert.

Both routers score every expert with ``scoring_func`` (V4: sqrt(softplus(logit))); the top-k router picks the k
best of score + ``e_score_correction_bias``, the hash router takes ``tid2eid[input_id]`` (the first
``mlp_layer_types == "hash_moe"`` layers). The chosen scores, normalized to sum 1 and times
``routed_scaling_factor``, weight the experts. Experts and the shared expert are SwiGLU with clipped
pre-activations: gate <= ``swiglu_limit``, |up| <= ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.layers.linear import Linear


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, limit: float) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(hidden[t]): hidden [T, D], w13 [E, 2I, D] (gate rows, then up),
    w2 [E, D, I]. The (token, expert) pairs are sorted by expert once; each active expert runs two matmuls over
    its slice (one host sync for the slice bounds)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    x = hidden[order // top_k]
    out = torch.empty(x.shape[0], w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
            out[rows] = F.linear(clamped_swiglu(gate, up, limit), w2[expert])
            start += count
    weighted = out * weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    return torch.zeros_like(hidden).index_add_(0, order // top_k, weighted)


class V4Router(nn.Module):
    """Expert ids and weights [T, k] for each token; ``hashed`` routers read ``tid2eid`` instead of the top-k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, vocab_size: int, hashed: bool, scoring_func: str,
                 scaling: float):
        super().__init__()
        self.top_k, self.hashed, self.scoring_func, self.scaling = top_k, hashed, scoring_func, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        if hashed:  # a parameter, not a buffer, so dummy weights fill it too (``dummy_init``)
            self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.int64), requires_grad=False)
            self.tid2eid.dummy_init = self._dummy_hash
        else:
            self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))  # e_score_correction_bias

    def _dummy_hash(self, std: float, generator: torch.Generator) -> None:
        """Dummy weights: k distinct random experts per token id, as a trained table spreads tokens (an all-zero
        table would send every token to expert 0 and fake the MoE's speed)."""
        num_experts = self.weight.shape[0]
        keys = torch.rand(self.tid2eid.shape[0], num_experts, generator=generator, device=self.tid2eid.device)
        self.tid2eid.data.copy_(keys.argsort(dim=-1)[:, :self.top_k])

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = expert_scores(F.linear(x, self.weight), self.scoring_func)
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class SharedExpert(nn.Module):
    """The always-on expert: w1 (gate), w3 (up), w2 (down), as the checkpoint names them."""

    def __init__(self, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.w1, self.w3, self.w2 = Linear(hidden, intermediate), Linear(hidden, intermediate), Linear(intermediate,
                                                                                                       hidden)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4Experts(nn.Module):
    """The routed experts stacked: ``w13`` [E, 2I, D] (w1 rows then w3 rows), ``w2`` [E, D, I]; the checkpoint's
    per-expert tensors (``experts.E.w1.weight``...) load into their slices (``load_expert``)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.intermediate, self.limit = intermediate, limit
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)

    def target(self, expert: int, which: str) -> torch.Tensor:
        """The slice that the checkpoint's ``experts.{expert}.{which}.weight`` fills."""
        inter = self.intermediate
        if which == "w2":
            return self.w2.data[expert]
        return self.w13.data[expert, :inter] if which == "w1" else self.w13.data[expert, inter:]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return clamped_experts(x, self.w13, self.w2, weights, ids, self.limit)


class V4MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, vocab_size: int, hashed: bool,
                 scoring_func: str, scaling: float, limit: float):
        super().__init__()
        self.gate = V4Router(hidden, num_experts, top_k, vocab_size, hashed, scoring_func, scaling)
        self.experts = V4Experts(num_experts, hidden, intermediate, limit)
        self.shared_experts = SharedExpert(hidden, intermediate, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)
