"""V4's MoE block: routed experts chosen by a learned top-k or by a frozen token hash, plus one shared expert.

Both routers score every expert with ``scoring_func`` (V4: sqrt(softplus(logit))); the top-k router picks the k
best of score + ``e_score_correction_bias``, the hash router takes ``tid2eid[input_id]`` (the first
``mlp_layer_types == "hash_moe"`` layers). The chosen scores, normalized to sum 1 and times
``routed_scaling_factor``, weight the experts. Experts and the shared expert are SwiGLU with clipped
pre-activations: gate <= ``swiglu_limit``, |up| <= ``swiglu_limit``. The routed experts run through the fused MoE op
(``ops.moe.fused_moe``, its ``swiglu_limit``): the Triton grouped GEMMs on CUDA, which read nothing on the host;
decode steps take its ``static`` torch path elsewhere (no host read either), prompt steps the sorted one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer import batch_invariant
from dsinfer.layers.linear import Linear
from dsinfer.ops.moe import fused_moe


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


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
        if batch_invariant.is_enabled():  # the deterministic mode sums the pairs in expert-id order
            ids = ids.sort(dim=-1).values
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

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, static: bool = False) -> torch.Tensor:
        """``static``: a decode step (``ops.moe.fused_moe``'s host-read-free torch path)."""
        return fused_moe(x, self.w13, self.w2, weights, ids, swiglu_limit=self.limit, static=static)


class V4MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, vocab_size: int, hashed: bool,
                 scoring_func: str, scaling: float, limit: float):
        super().__init__()
        self.gate = V4Router(hidden, num_experts, top_k, vocab_size, hashed, scoring_func, scaling)
        self.experts = V4Experts(num_experts, hidden, intermediate, limit)
        self.shared_experts = SharedExpert(hidden, intermediate, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, static: bool = False) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids, static) + self.shared_experts(x)
