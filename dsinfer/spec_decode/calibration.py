"""Online calibration of draft confidence: acceptance counted by draft position, per request and drafter-wide.

A step that verifies m drafts of a request and keeps r of them reached positions 0..min(r, m - 1): the first r
were kept and, when r < m, position r was rejected; later positions were never reached, so they count nothing.
The rate at position j is then P(draft j kept | drafts before it kept), the factor the prefix rule multiplies.
A request's own rate is shrunk toward the drafter-wide one (``prior_weight`` pseudo-observations), which is
itself shrunk toward ``initial`` until it has seen drafts.

A drafter with a probability of its own for each draft (MTP: its softmax) is calibrated by ratio instead
(``ScaledCalibrator``): per position, kept / (sum of the confidences it predicted where drafts were reached), per
request shrunk toward drafter-wide, multiplies its next confidences (clipped to [0, 1]); an over-confident draft
layer is scaled down where its drafts fare worse than it says.
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


class ScaledCounts:
    """Per position: the confidences predicted where drafts were reached, and the drafts kept there."""

    def __init__(self, num_positions: int):
        self.predicted = np.zeros(num_positions, dtype=np.float64)
        self.kept = np.zeros(num_positions, dtype=np.float64)

    def observe(self, confidence: list[float], num_verified: int, num_kept: int) -> None:
        num_verified = min(num_verified, len(self.kept), len(confidence))
        num_kept = min(num_kept, num_verified)
        reached = min(num_kept + 1, num_verified)
        self.predicted[:reached] += np.asarray(confidence[:reached], dtype=np.float64)
        self.kept[:num_kept] += 1

    def factors(self, prior: np.ndarray, prior_weight: float) -> np.ndarray:
        return (self.kept + prior_weight * prior) / (self.predicted + prior_weight)


class ScaledCalibrator:
    """Calibrates a drafter's own confidences by the observed kept / predicted ratio per position."""

    def __init__(self, num_positions: int, prior_weight: float = 4.0):
        self.num_positions = num_positions
        self.prior_weight = prior_weight
        self.total = ScaledCounts(num_positions)

    def new_request(self) -> ScaledCounts:
        return ScaledCounts(self.num_positions)

    def observe(self, counts: ScaledCounts, confidence: list[float], num_verified: int, num_kept: int) -> None:
        counts.observe(confidence, num_verified, num_kept)
        self.total.observe(confidence, num_verified, num_kept)

    def calibrated(self, counts: ScaledCounts, confidence: list[float]) -> list[float]:
        n = min(len(confidence), self.num_positions)
        prior = self.total.factors(np.ones(self.num_positions), self.prior_weight)
        scaled = np.asarray(confidence[:n], dtype=np.float64) * counts.factors(prior, self.prior_weight)[:n]
        return np.clip(scaled, 0.0, 1.0).tolist() + list(confidence[n:])
