"""Online calibration of draft confidence: acceptance counted by draft position, per request and drafter-wide.

A step that verifies m drafts of a request and keeps r of them reached positions 0..min(r, m - 1): the first r
were kept and, when r < m, position r was rejected; later positions were never reached, so they count nothing.
The rate at position j is then P(draft j kept | drafts before it kept), the factor the prefix rule multiplies.
A request's own rate is shrunk toward the drafter-wide one (``prior_weight`` pseudo-observations), which is
itself shrunk toward ``initial`` until it has seen drafts.
"""

from __future__ import annotations

import numpy as np


class AcceptanceCounts:
    """Reached / kept counts by draft position (0-based)."""

    def __init__(self, num_positions: int):
        self.reached = np.zeros(num_positions, dtype=np.float64)
        self.kept = np.zeros(num_positions, dtype=np.float64)

    def observe(self, num_verified: int, num_kept: int) -> None:
        num_verified = min(num_verified, len(self.reached))
        num_kept = min(num_kept, num_verified)
        self.kept[:num_kept] += 1
        self.reached[:min(num_kept + 1, num_verified)] += 1

    def rates(self, prior: np.ndarray, prior_weight: float) -> np.ndarray:
        return (self.kept + prior_weight * prior) / (self.reached + prior_weight)


class Calibrator:
    """Per-position acceptance estimates for every request of one drafter."""

    def __init__(self, num_positions: int, initial: float = 0.5, prior_weight: float = 4.0):
        self.num_positions = num_positions
        self.initial = np.full(num_positions, initial)
        self.prior_weight = prior_weight
        self.total = AcceptanceCounts(num_positions)

    def new_request(self) -> AcceptanceCounts:
        return AcceptanceCounts(self.num_positions)

    def observe(self, counts: AcceptanceCounts, num_verified: int, num_kept: int) -> None:
        counts.observe(num_verified, num_kept)
        self.total.observe(num_verified, num_kept)

    def confidence(self, counts: AcceptanceCounts, num_tokens: int) -> list[float]:
        prior = self.total.rates(self.initial, self.prior_weight)
        return counts.rates(prior, self.prior_weight)[:num_tokens].tolist()
