"""The engine's speculative-decoding counters (vLLM's ``SpecDecodingStats``, plus what was proposed).

``num_drafts``: request-steps that verified at least one draft; ``num_draft_tokens``: drafts verified (vLLM's
name; ``num_verified_tokens`` in ``as_dict`` too); ``num_proposals``: request-steps the drafter proposed at least
one draft for; ``num_proposed_tokens``: drafts the drafter proposed (more than verified when the budget, the
request's room or confidence scheduling cut them); ``num_accepted_tokens``: drafts kept;
``accepted_per_position[j]``: steps that kept draft j. Mean acceptance length, vLLM's: 1 + accepted / drafts
(tokens a verifying step gives a request); verified per proposal: drafts verified per request-step that had
drafts (DSpark's "verified drafts per step": k without confidence scheduling, fewer with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_proposals: int = 0
    num_proposed_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_verified: int, num_accepted: int) -> None:
        if not num_verified:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        for j in range(min(num_accepted, self.num_speculative_tokens)):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def verified_per_proposal(self) -> float:
        return self.num_draft_tokens / self.num_proposals if self.num_proposals else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_proposals": self.num_proposals,
                "num_proposed_tokens": self.num_proposed_tokens, "num_draft_tokens": self.num_draft_tokens,
                "num_verified_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "verified_per_proposal": self.verified_per_proposal,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}
