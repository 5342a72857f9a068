"""The MTP drafter's engine side: the worker computes MTP drafts right after each step's target forward
(``runner.mtp_proposer``) and returns them in the ``RunnerOutput``; this hands them out at the next step.

A request's drafts follow the tokens it had once that step's tokens were appended; ``propose`` gives them only
while the request still has exactly those tokens (a request stopped, preempted or resumed since gets none until
its next sampling step brings new ones). Confidence: the MTP layer's own softmax probability of each draft.
"""

from __future__ import annotations

import weakref

from dsinfer.core.request import Request
from dsinfer.spec_decode.base import Draft


class MTPDrafter:
    def __init__(self) -> None:
        # request -> (its token count the drafts follow, the drafts)
        self._drafts: weakref.WeakKeyDictionary[Request, tuple[int, Draft]] = weakref.WeakKeyDictionary()

    def receive(self, request: Request, token_ids: list[int], confidence: list[float]) -> None:
        """The worker's drafts for ``request`` as it stands now (after this step's tokens were appended)."""
        self._drafts[request] = (request.num_tokens, Draft(list(token_ids), list(confidence)))

    def propose(self, request: Request, num_tokens: int) -> Draft:
        num, draft = self._drafts.pop(request, (-1, Draft()))
        return draft.truncated(num_tokens) if num == request.num_tokens else Draft()
