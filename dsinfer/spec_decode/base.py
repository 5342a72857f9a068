"""The drafter interface: propose draft tokens for a running request, each with a predicted acceptance.

``Drafter.propose`` may return a plain list of ids (a stand-in with no confidence: every draft is taken as
certain) or a ``Draft``. ``observe`` (optional) hears how many of the verified drafts the target kept, which is
what a drafter calibrates its confidence from. ``receive`` (optional) takes the drafts a worker computed for a
request during its step (``RunnerOutput.draft_token_ids``: the MTP layer runs beside the target), once the step's
tokens are appended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dsinfer.core.request import Request


@dataclass
class Draft:
    """Draft token ids and, per token, the predicted probability that the target keeps it given that it keeps
    every draft before it (so a prefix survives with the product of its confidences)."""

    token_ids: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.confidence:
            self.confidence = [1.0] * len(self.token_ids)
        assert len(self.confidence) == len(self.token_ids), "one confidence per draft token"

    def truncated(self, n: int) -> Draft:
        return Draft(self.token_ids[:n], self.confidence[:n])

    def survival(self) -> list[float]:
        """P(drafts[:j + 1] are all kept), j = 0..k-1 (the prefix rule: a draft counts only if all before it do)."""
        out, p = [], 1.0
        for c in self.confidence:
            p *= c
            out.append(p)
        return out


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for a running request, verified by its next step (speculative decoding)."""

    def propose(self, request: Request, num_tokens: int) -> Draft | list[int]:
        """Up to ``num_tokens`` tokens likely to follow ``request.all_token_ids``."""


def as_draft(proposal: Draft | list[int], num_tokens: int) -> Draft:
    """A drafter's proposal as a ``Draft`` of at most ``num_tokens`` tokens."""
    draft = proposal if isinstance(proposal, Draft) else Draft([int(t) for t in proposal])
    return draft.truncated(num_tokens)
