"""N-gram prompt lookup: draft the tokens that followed the last occurrence of the request's newest n tokens.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the newest n tokens of prompt + output are
searched for in the tokens before them (vectorized: the positions holding the n-gram's first token are found by
one numpy comparison over the sequence, then only they are checked against the rest); the most recent match of
the longest n wins and the k tokens after it are the draft. A match whose continuation runs into the newest
tokens repeats with the match's period (``a b a b`` continues ``a b``), which is what a loop would produce.

Each request's tokens are kept in a growing numpy buffer (tokens are only ever appended to a request), so a step
copies only its new tokens. Confidence per draft position: the request's acceptance rate there, calibrated online
(``calibration``).
"""

from __future__ import annotations

import weakref

import numpy as np

from dsinfer.config import SpeculativeConfig
from dsinfer.core.request import Request
from dsinfer.spec_decode.base import Draft
from dsinfer.spec_decode.calibration import AcceptanceCounts, Calibrator


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The draft of up to ``k`` tokens for ``tokens`` (int64 [L]); [] when no n-gram of length in
    [min_n, max_n] recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # candidate starts i in [0, L - n - 1]: the match must end before the suffix starts being itself
        starts = np.flatnonzero(tokens[:length - n] == suffix[0])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if len(starts):
            start = int(starts[-1]) + n  # the most recent match; its continuation starts here
            period = length - start  # > 0: the continuation is followed by the suffix itself
            index = start + np.arange(k) % period
            return tokens[index].tolist()
    return []


class _RequestTokens:
    __slots__ = ("buffer", "length", "counts")

    def __init__(self, counts: AcceptanceCounts):
        self.buffer = np.zeros(64, dtype=np.int64)
        self.length = 0
        self.counts = counts

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n > len(self.buffer):
            grown = np.zeros(max(n, 2 * len(self.buffer)), dtype=np.int64)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        if n > self.length:
            self.buffer[self.length:n] = token_ids[self.length:n]
        self.length = n
        return self.buffer[:n]


class NgramDrafter:
    proposes_ahead = True  # drafts from the tokens it sees, so it may guess past a token still in flight

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.calibrator = Calibrator(max(config.num_speculative_tokens, 1))
        self._requests: weakref.WeakKeyDictionary[Request, _RequestTokens] = weakref.WeakKeyDictionary()

    def _state(self, request: Request) -> _RequestTokens:
        state = self._requests.get(request)
        if state is None:
            state = self._requests[request] = _RequestTokens(self.calibrator.new_request())
        return state

    def propose(self, request: Request, num_tokens: int) -> Draft:
        state = self._state(request)
        tokens = state.sync(request.all_token_ids)
        ids = find_ngram_draft(tokens, self.min_n, self.max_n, min(num_tokens, self.calibrator.num_positions))
        return Draft(ids, self.calibrator.confidence(state.counts, len(ids)))

    def observe(self, request: Request, num_verified: int, num_kept: int) -> None:
        """The request's last step verified ``num_verified`` drafts and kept the first ``num_kept``."""
        if num_verified:
            self.calibrator.observe(self._state(request).counts, num_verified, num_kept)
