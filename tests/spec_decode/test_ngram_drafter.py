"""The n-gram prompt-lookup drafter: longest n first, most recent match, a loop's continuation, calibration."""

from __future__ import annotations

import numpy as np
import pytest

from dsinfer.config import SpeculativeConfig
from dsinfer.core.plan import RequestSampling
from dsinfer.core.request import Request
from dsinfer.spec_decode.base import Draft
from dsinfer.spec_decode.calibration import AcceptanceCounts
from dsinfer.spec_decode.metrics import SpecDecodeStats
from dsinfer.spec_decode.ngram import NgramDrafter, find_ngram_draft


def draft(tokens, min_n=1, max_n=3, k=4):
    return find_ngram_draft(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "5 6 7" recurs once (followed by 1 2); "6 7" alone recurs later (followed by 9)
    assert draft([5, 6, 7, 1, 2, 3, 6, 7, 9, 4, 5, 6, 7]) == [1, 2, 3, 6]


def test_the_most_recent_match_of_one_length_wins():
    assert draft([8, 9, 1, 1, 8, 9, 2, 2, 8, 9], min_n=2, max_n=2, k=2) == [2, 2]


def test_a_match_running_into_the_suffix_continues_with_its_period():
    assert draft([3, 4, 3, 4, 3, 4], min_n=2, max_n=2, k=5) == [3, 4, 3, 4, 3]
    assert draft([7, 7, 7], min_n=1, max_n=2, k=3) == [7, 7, 7]


def test_no_recurring_ngram_gives_no_draft():
    assert draft([1, 2, 3, 4, 5]) == []
    assert draft([1, 2, 3, 1, 2, 4], min_n=3, max_n=3) == []  # "2 4" recurs nowhere, 3-grams neither
    assert draft([9]) == []


def test_a_long_prompt_is_searched_without_a_python_loop_over_it():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 50_000, 200_000)
    tokens[1000:1006] = [1, 2, 3, 4, 5, 6]
    tokens[-3:] = [1, 2, 3]
    assert find_ngram_draft(tokens, 2, 3, 3) == [4, 5, 6]


def _request(tokens):
    sampling = RequestSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
    return Request("r", list(tokens), params=None, seed=0, max_tokens=8, sampling=sampling)


def test_drafter_follows_a_growing_request_and_calibrates_by_position():
    drafter = NgramDrafter(SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=2))
    request = _request([1, 2, 3, 1, 2])
    first = drafter.propose(request, 3)
    assert first.token_ids == [3, 1, 2] and first.confidence == pytest.approx([0.5, 0.5, 0.5])
    for _ in range(8):  # the first draft always kept, the second never
        drafter.observe(request, 3, 1)
    request.append_token(3)
    second = drafter.propose(request, 3)
    assert second.token_ids == [1, 2, 3]
    c0, c1, c2 = second.confidence
    assert c0 > 0.8 and c1 < 0.2 and c2 == pytest.approx(0.5)  # position 2 was never reached


def test_acceptance_counts_reach_only_up_to_the_first_rejection():
    counts = AcceptanceCounts(4)
    counts.observe(4, 1)  # kept 0, rejected 1, 2 and 3 never reached
    counts.observe(2, 2)  # both kept
    assert counts.reached.tolist() == [2, 2, 0, 0] and counts.kept.tolist() == [2, 1, 0, 0]


def test_survival_is_the_product_of_confidences():
    assert Draft([1, 2, 3], [0.9, 0.5, 0.5]).survival() == pytest.approx([0.9, 0.45, 0.225])


def test_stats_count_drafts_positions_and_mean_acceptance_length():
    stats = SpecDecodeStats(3)
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(0, 0)  # no draft verified: not a draft
    assert stats.num_drafts == 2 and stats.num_draft_tokens == 6 and stats.num_accepted_tokens == 4
    assert stats.accepted_per_position == [2, 1, 1]
    assert stats.mean_acceptance_length == 3.0
