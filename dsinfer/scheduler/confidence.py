"""Confidence-scheduled verification: verify only the drafts whose expected gain pays for their cost.

Each draft token carries a predicted acceptance (its drafter's confidence, calibrated online per request and
position), so draft j of a request survives with the product of the first j + 1 (the prefix rule: a draft is
kept only if every one before it is). A step gives each decoding request one token for sure, plus its kept
drafts, and costs ``curve(tokens)`` seconds (``core.step_latency``). Every (request, position) slot is sorted by
survival (a request's survivals never rise with position, so the order keeps each request's prefix whole) and
the step verifies the prefix of that order with the most expected tokens per second:
``(guaranteed + sum of admitted survivals) / curve(base tokens + admitted)``; ties go to fewer drafts.

Where the runner pads a decode step to its longest query so that it replays a CUDA graph (``DecodePadding``), a
step of B decoding sequences whose longest verifies L drafts costs ``curve(B x (1 + L))`` however many drafts the
others verify: mixed lengths cost what the longest does. There every request verifies up to the same L (all of its
drafts when it has fewer), and L is the one with the most expected tokens per second (ties: the shorter). Steps
the runner does not pad (prompt chunks beside the decodes, more sequences than its largest graph) are priced by
their tokens as above.

A request whose drafts went unverified for ``probe_every`` of its steps has its first draft verified anyway, so
its calibration keeps hearing how its drafts fare (a rate that was low would otherwise never learn it rose).
Plain data in and out: it reads confidences and the curve, never a device, and under overlap scheduling decides
with the rates it has (one step old), never waiting for the GPU. Which drafts are verified changes speed, never
tokens.
"""

from __future__ import annotations

import numpy as np

from dsinfer.core.step_latency import DecodePadding, StepLatencyCurve


class ConfidenceScheduler:
    def __init__(self, curve: StepLatencyCurve, probe_every: int = 8, padding: DecodePadding = DecodePadding()):
        """``padding``: the steps the runner pads to their longest query (priced so); the default: none."""
        self.curve = curve
        self.probe_every = probe_every
        self.padding = padding
        self._unverified: dict[str, int] = {}  # request id -> its steps in a row that verified no draft

    def select(self, confidences: dict[str, list[float]], base_tokens: int, guaranteed: int) -> dict[str, int]:
        """Drafts to verify per request (a prefix of each), given every candidate request's draft confidences,
        the step's other tokens (``base_tokens``: every scheduled token but drafts) and the tokens it gives for
        sure (``guaranteed``: one per sampling request)."""
        self._unverified = {rid: self._unverified.get(rid, 0) for rid in confidences}
        if not self.curve.ready:  # no price yet: verify everything (the real steps build the curve)
            return {rid: len(conf) for rid, conf in confidences.items()}
        chosen = {rid: 0 for rid in confidences}
        survivals, owners = [], []
        expected = float(guaranteed)
        for rid, conf in confidences.items():
            surv = np.cumprod(np.asarray(conf, dtype=np.float64))
            if len(surv) and self._unverified[rid] + 1 >= self.probe_every:  # a probe: its first draft
                chosen[rid] = 1
                expected += surv[0]
                surv = surv[1:]
            survivals.append(surv)
            owners.append(np.full(len(surv), len(owners), dtype=np.int64))
        base = base_tokens + sum(chosen.values())
        longest = 1 + max((len(conf) for conf in confidences.values()), default=0)
        if confidences and base_tokens == guaranteed and self.padding.pads(guaranteed, longest):  # padded decode
            self._admit_padded(confidences, chosen, guaranteed)
        elif survivals:
            self._admit(np.concatenate(survivals), np.concatenate(owners), list(confidences), chosen, base,
                        expected)
        for rid, n in chosen.items():
            self._unverified[rid] = 0 if n else self._unverified[rid] + 1
        return chosen

    def _admit_padded(self, confidences: dict[str, list[float]], chosen: dict[str, int], num_seqs: int) -> None:
        """Every request verifies up to the same number of drafts L (at least its probe's), the L whose expected
        tokens per second, ``(num_seqs + sum of survivals up to L) / curve(num_seqs x (1 + L))``, is highest."""
        gains = [np.concatenate([[0.0], np.cumsum(np.cumprod(np.asarray(conf, dtype=np.float64)))])
                 for conf in confidences.values()]
        lengths = np.arange(max(chosen.values()), max(len(g) for g in gains))  # up to the most drafts any has
        expected = num_seqs + sum(g[np.minimum(lengths, len(g) - 1)] for g in gains)
        longest = int(lengths[int(np.argmax(expected / self.curve(num_seqs * (1 + lengths))))])
        for rid, conf in confidences.items():
            chosen[rid] = min(longest, len(conf))

    def _admit(self, survival: np.ndarray, owner: np.ndarray, rids: list[str], chosen: dict[str, int],
               base: int, expected: float) -> None:
        if not len(survival):
            return
        order = np.argsort(-survival, kind="stable")  # stable: a request's positions stay in order on ties
        gain = expected + np.concatenate([[0.0], np.cumsum(survival[order])])
        rate = gain / self.curve(base + np.arange(len(order) + 1))
        best = int(np.argmax(rate))  # the first maximum: ties go to fewer drafts
        for i in order[:best]:
            chosen[rids[owner[i]]] += 1
