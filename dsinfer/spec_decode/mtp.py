"""The MTP drafter's engine side: the worker computes MTP drafts right after each step's target forward
(``runner.mtp_proposer``) and returns them in the ``RunnerOutput``; this hands them out at the next step.

A request's drafts follow the tokens it had once that step's tokens were appended; ``propose`` gives them only
while the request still has exactly those tokens (a request stopped, preempted or resumed since gets none until
its next sampling step brings new ones). Confidence: the MTP layer's own softmax probability of each draft,
calibrated online per request and position from how its drafts fared (``calibration.ScaledCalibrator``).
"""

from __future__ import annotations

import weakref

from dsinfer.core.request import Request
from dsinfer.spec_decode.base import Draft
from dsinfer.spec_decode.calibration import ScaledCalibrator, ScaledCounts


class MTPDrafter:
    def __init__(self, num_speculative_tokens: int = 1) -> None:
        # request -> (its token count the drafts follow, the drafts)
        self._drafts: weakref.WeakKeyDictionary[Request, tuple[int, Draft]] = weakref.WeakKeyDictionary()
        self.calibrator = ScaledCalibrator(max(num_speculative_tokens, 1))
        # request -> (its calibration counts, the raw confidences of the drafts last handed out)
        self._counts: weakref.WeakKeyDictionary[Request, tuple[ScaledCounts, list[float]]] = \
            weakref.WeakKeyDictionary()

    def receive(self, request: Request, token_ids: list[int], confidence: list[float]) -> None:
        """The worker's drafts for ``request`` as it stands now (after this step's tokens were appended)."""
        self._drafts[request] = (request.num_tokens, Draft(list(token_ids), list(confidence)))

    def propose(self, request: Request, num_tokens: int) -> Draft:
        num, draft = self._drafts.pop(request, (-1, Draft()))
        if num != request.num_tokens:
            return Draft()
        draft = draft.truncated(num_tokens)
        counts = self._state(request)
        self._counts[request] = (counts, list(draft.confidence))
        return Draft(draft.token_ids, self.calibrator.calibrated(counts, draft.confidence))

    def observe(self, request: Request, num_verified: int, num_kept: int) -> None:
        """The drafts last handed out for ``request``: the first ``num_verified`` verified, ``num_kept`` kept."""
        counts, raw = self._counts.get(request, (None, []))
        if counts is not None and num_verified:
            self.calibrator.observe(counts, raw, num_verified, num_kept)

    def _state(self, request: Request) -> ScaledCounts:
        entry = self._counts.get(request)
        return entry[0] if entry is not None else self.calibrator.new_request()
