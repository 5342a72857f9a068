"""The sampler: logits of the rows that sample -> next tokens (+ logprobs), vectorized over the batch.

Logprobs of the raw logits are taken first, as in vLLM; then come logit bias, penalties, the grammar's mask and the
bans (min_tokens, allowed_token_ids, bad words; ``_ban`` says how they yield to a grammar). Greedy rows take the
argmax; the others are scaled by temperature, filtered by top-k / top-p / min-p and sampled with the Gumbel-max
trick using noise keyed by (seed, position) (``ops/noise.py``), so a seeded request draws the same tokens
whatever batch it runs in.

Rows that verify a draft token: by default each samples as if it were its request's only row, and the runner
keeps the draft while it equals that sample ("exact" acceptance). With ``draft_ids`` set ("rejection"
acceptance, q one-hot on the draft d) a sampled row keeps d with probability p(d), p its final distribution
(after every rule above), and otherwise draws from p with d removed: the row's token is distributed as p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer import ops
from dsinfer.ops.noise import acceptance_uniform


@dataclass
class SamplingBatch:
    """Per-row sampling inputs (one row per request that samples this step), built by the runner."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, vocab size where disabled
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64: position of the token being sampled
    all_greedy: bool
    use_top_k: bool
    max_top_k: int  # host-side max of top_k (sizes the topk call without reading the tensor)
    use_top_p: bool
    use_min_p: bool
    penalties: Penalties | None = None
    logit_bias: torch.Tensor | None = None  # [S, V] float32 additive
    banned: torch.Tensor | None = None  # [S, V] bool: must not be sampled (min_tokens, allowed_token_ids, bad words)
    token_bitmask: torch.Tensor | None = None  # [S, ceil(V/32)] int32 packed grammar mask (ops.apply_token_bitmask)
    num_logprobs: int | None = None  # top-k logprobs to return (None: none)
    draft_ids: torch.Tensor | None = None  # [S] int64: the draft a row verifies (-1: none), rejection acceptance


@dataclass
class Penalties:
    repetition: torch.Tensor  # [S] float32
    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    output_counts: torch.Tensor  # [S, V] float32: occurrences in the output so far
    prompt_mask: torch.Tensor  # [S, V] bool: token occurs in the prompt


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    # When logprobs were asked for: ids [S, K + 1] (sampled token first), their logprobs, and the sampled rank.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (prompt + output, HF rule), then frequency and presence (output only, OpenAI rule)."""
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = p.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - p.frequency.unsqueeze(1) * p.output_counts
    return logits - p.presence.unsqueeze(1) * (p.output_counts > 0).float()


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set tokens outside each row's top-k / top-p / min-p set to -inf (the top token always survives)."""
    if batch.use_top_k:
        kth = logits.topk(batch.max_top_k, dim=-1).values
        threshold = kth.gather(1, (batch.top_k.clamp(max=kth.shape[1]) - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if batch.use_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before > batch.top_p.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if batch.use_min_p:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor, k: int):
    logprobs = raw_logits.log_softmax(dim=-1)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat((sampled.unsqueeze(1), top_ids), dim=1)
        return ids, torch.cat((sampled_lp, top_lp), dim=1), ranks
    return sampled.unsqueeze(1), sampled_lp, ranks


def _plain_greedy(batch: SamplingBatch) -> bool:
    """Argmax of the logits as they are: nothing added, masked or scored."""
    return (batch.all_greedy and batch.logit_bias is None and batch.penalties is None and batch.banned is None
            and batch.token_bitmask is None and batch.num_logprobs is None)


def _ban(logits: torch.Tensor, banned: torch.Tensor, grammar: bool) -> torch.Tensor:
    """Mask the banned tokens. In a batch with grammars, a row the bans would leave with no token keeps the
    grammar's tokens: a grammar complete before min_tokens allows only EOS, which min_tokens bans, and its end
    wins (as do its tokens over allowed_token_ids / bad_words that exclude them all): the request never samples
    a token its grammar forbids. Without a grammar the engine checks at add_request that something is left."""
    kept = logits.masked_fill(banned, float("-inf"))
    if not grammar:
        return kept
    emptied = kept.isneginf().all(dim=-1, keepdim=True)
    return torch.where(emptied, logits, kept)


def verify_by_rejection(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Rejection sampling against a one-hot draft: row r with draft d keeps d when u < p(d) (u the row's
    acceptance coin, p = softmax(logits / T) of the filtered logits), else samples p with d masked out; rows
    without a draft, and greedy rows (whose draft the runner checks against the argmax), sample as usual."""
    drafts = batch.draft_ids
    verifying = (drafts >= 0) & (batch.temperature > 0)
    index = drafts.clamp(min=0).unsqueeze(1)
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0).unsqueeze(1)
    p_draft = (logits / temperature).log_softmax(dim=-1).gather(1, index).squeeze(1).exp()
    keep = verifying & (acceptance_uniform(batch.seeds, batch.positions) < p_draft)
    without = logits.scatter(1, index, float("-inf"))
    residual = torch.where(verifying.unsqueeze(1), without, logits)
    resampled = ops.gumbel_argmax(residual, batch.seeds, batch.positions, batch.temperature)
    return torch.where(keep, drafts, resampled)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits`` [S, V]: float32, or 16-bit (the decode graphs' output), which a plain greedy batch takes the
        argmax of directly (an exact upcast keeps the order and the first maximum) and anything else upcasts."""
        if logits.dtype != torch.float32 and not _plain_greedy(batch):
            logits = logits.float()
        raw = logits
        if batch.logit_bias is not None:
            logits = logits + batch.logit_bias
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.token_bitmask is not None:
            logits = ops.apply_token_bitmask(logits, batch.token_bitmask)
        if batch.banned is not None:
            logits = _ban(logits, batch.banned, grammar=batch.token_bitmask is not None)
        if batch.all_greedy:
            sampled = ops.greedy_argmax(logits)
        else:
            # Filter on the temperature-scaled distribution, sample from the unscaled logits (the op divides).
            greedy = batch.temperature == 0
            scaled = logits / torch.where(greedy, 1.0, batch.temperature).unsqueeze(1)
            if batch.use_top_k or batch.use_top_p or batch.use_min_p:
                dropped = filter_logits(scaled, batch).isneginf() & ~greedy.unsqueeze(1)
                logits = logits.masked_fill(dropped, float("-inf"))
            if batch.draft_ids is not None:
                sampled = verify_by_rejection(logits, batch)
            else:
                sampled = ops.gumbel_argmax(logits, batch.seeds, batch.positions, batch.temperature)
        out = SamplerOutput(sampled)
        if batch.num_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = _logprobs(raw, sampled, batch.num_logprobs)
        return out
