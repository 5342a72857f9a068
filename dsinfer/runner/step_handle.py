"""A launched step (``StepHandle``): its GPU work queued, its sampled tokens on their way to pinned host memory;
``result()`` turns them into the step's RunnerOutput. And the host-side helpers of that output."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.core.outputs import RunnerOutput, TokenLogprobs
from dsinfer.runner.input_batch import SampleRow


class StepHandle:
    """A launched step: its GPU work is queued and its sampled tokens are on their way to pinned host memory.

    ``result()`` waits for that copy (the step's one host sync), verifies drafts and returns the RunnerOutput.
    With async scheduling the engine launches the next step before calling it, so the CPU work overlaps the GPU's.
    """

    def __init__(self, rows: list[SampleRow], copies: dict[str, torch.Tensor],
                 prompt_logprobs: dict[str, list[TokenLogprobs]], done: torch.cuda.Event | None,
                 draft: Callable[[list[int]], tuple[dict, dict]] | None = None, kv: dict | None = None):
        """``draft``: the step's sampled tokens -> the next drafts and their confidences (MTP drafting);
        ``kv``: the KV store's RunnerOutput fields (``ModelRunner._kv_report``)."""
        self.rows = rows
        self._copies = copies
        self._prompt_logprobs = prompt_logprobs
        self._done = done
        self._draft = draft
        self._kv = kv or {}
        self.eplb_stats: dict[str, int] | None = None  # EPLB's rebalance totals, sent with the expert load

    def result(self) -> RunnerOutput:
        if self._done is not None:
            self._done.synchronize()
        out = RunnerOutput(prompt_logprobs=self._prompt_logprobs, **self._kv)
        if "expert_load" in self._copies:
            out.expert_load = self._copies["expert_load"].tolist()
            out.eplb_stats = self.eplb_stats
        if not self.rows:
            return out
        tokens = self._copies["tokens"].tolist()
        logprobs = self._logprobs()
        rejected: str | None = None  # a request whose draft was rejected: its later rows are not its tokens
        for i, (row, token) in enumerate(zip(self.rows, tokens)):
            rid = row.state.request_id
            if rid == rejected:
                continue
            out.sampled_token_ids.setdefault(rid, []).append(token)
            if logprobs is not None and row.state.sampling.logprobs is not None:
                out.logprobs.setdefault(rid, []).append(logprobs[i])
            rejected = rid if row.draft is not None and token != row.draft else None
        if self._draft is not None:
            out.draft_token_ids, out.draft_confidence = self._draft(tokens)
        return out

    def _logprobs(self) -> list[TokenLogprobs] | None:
        if "logprobs" not in self._copies:
            return None
        ids, lps = self._copies["logprob_ids"].tolist(), self._copies["logprobs"].tolist()
        ranks = self._copies["ranks"].tolist()
        out = []
        for row, (i, lp, rank) in enumerate(zip(ids, lps, ranks)):
            k = self.rows[row].state.sampling.logprobs
            out.append(TokenLogprobs(i[:k + 1], lp[:k + 1], rank) if k is not None else None)
        return out


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy into pinned host memory (complete once the step's done event has fired)."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Each target token's logprob and rank under ``logits`` and the top ``k`` beside it (prompt logprobs)."""
    logprobs = logits.log_softmax(dim=-1)
    target_lp = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat((targets.unsqueeze(1), top_ids), 1).tolist()
        lps = torch.cat((target_lp, top_lp), 1).tolist()
    else:
        ids, lps = targets.unsqueeze(1).tolist(), target_lp.tolist()
    return [TokenLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks)]
