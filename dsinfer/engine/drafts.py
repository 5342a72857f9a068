"""The engine's side of speculative decoding: before each step, each decoding request's drafts from the drafter
(with their confidences; which of them a step verifies is the scheduler's choice under confidence scheduling);
after it, how many the step kept, to the drafter's calibration and the verified-draft metrics.

Under async scheduling a request whose one-token step is in flight gets drafts proposed one token ahead (from the
tokens known, the first draft standing for the token in flight, which the step reads as a placeholder; the drafts
after it are verified as any drafts are, so a wrong guess costs only acceptance)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from dsinfer.core.request import Request
from dsinfer.spec_decode.base import Draft, Drafter, as_draft
from dsinfer.spec_decode.metrics import SpecDecodeStats


class DraftProposer:
    def __init__(self, drafter: Drafter, num_speculative_tokens: int, structured: Callable[[], Any]):
        """``structured``: the engine's structured-output manager, asked for only when a grammar request has
        drafts (it is built on first use)."""
        self.drafter, self.k = drafter, num_speculative_tokens
        self.stats = SpecDecodeStats(num_speculative_tokens)
        self._structured = structured

    def propose(self, running: Iterable[Request]) -> None:
        """Set each decoding request's ``draft_token_ids`` / ``draft_confidence``. A request whose one-token step
        is in flight gets them one token ahead (``_ahead``); a grammar request's are cut at the first one its
        grammar forbids (checked without advancing the matcher)."""
        k = self.k
        for request in running:
            pending = request.num_pending
            if pending > 1 or request.num_computed_tokens + 1 != request.num_tokens + pending:
                continue
            draft = self._ahead(request) if pending else as_draft(self.drafter.propose(request, k), k)
            self.stats.num_proposed_tokens += len(draft.token_ids)
            self.stats.num_proposals += bool(draft.token_ids)
            if request.grammar is not None and draft.token_ids:
                draft = draft.truncated(self._structured().valid_drafts(request, draft.token_ids))
            request.draft_token_ids, request.draft_confidence = draft.token_ids, draft.confidence

    def _ahead(self, request: Request) -> Draft:
        """Drafts for the tokens after the one a step in flight samples: the drafter's k + 1 for the known tokens,
        less the first (its guess of the token in flight), whose confidence folds into the next one's."""
        draft = as_draft(self.drafter.propose(request, self.k + 1), self.k + 1)
        if len(draft.token_ids) < 2:
            return Draft()
        confidence = draft.confidence[1:]
        confidence[0] *= draft.confidence[0]
        return Draft(draft.token_ids[1:], confidence)

    def observe(self, request: Request, num_verified: int, num_accepted: int) -> None:
        """A step verified ``num_verified`` of the request's drafts and kept the first ``num_accepted``."""
        self.stats.observe(num_verified, num_accepted)
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:
            observe(request, num_verified, num_accepted)
