"""The confidence scheduler: (request, position) slots by survival, the prefix with the most expected tokens per
second on the step-latency curve, probes that keep calibration learning; and the Scheduler applying it."""

from __future__ import annotations

import pytest

from dsinfer.core.step_latency import DecodePadding, StepLatencyCurve
from dsinfer.scheduler.confidence import ConfidenceScheduler

FLAT = StepLatencyCurve({1: 1.0, 1024: 1.0})  # a memory-bound step: tokens cost nothing
AFFINE = StepLatencyCurve({1: 1.5, 64: 33.0})  # 1 + t / 2: a draft pays its half token only if likely kept


def test_a_free_step_verifies_every_draft():
    chosen = ConfidenceScheduler(FLAT).select({"a": [0.9, 0.9], "b": [0.1, 0.1, 0.1]}, base_tokens=2,
                                              guaranteed=2)
    assert chosen == {"a": 2, "b": 3}


def test_a_costly_step_verifies_only_the_drafts_that_pay():
    # base 2 tokens, 2 guaranteed: rate 2 / 2 = 1. a's drafts survive .9, .81, .729; b's .3, .09
    chosen = ConfidenceScheduler(AFFINE).select({"a": [0.9, 0.9, 0.9], "b": [0.3, 0.3]}, base_tokens=2,
                                                guaranteed=2)
    assert chosen == {"a": 3, "b": 0}


def test_slots_are_admitted_by_survival_across_requests_keeping_each_prefix():
    # b's first draft (0.95) outranks a's second (0.8 * 0.8 = 0.64), but b's second (0.95 * 0.1) ranks last
    curve = StepLatencyCurve({1: 1.0, 3: 1.0, 4: 1.6, 5: 2.4})  # two drafts are free, the third costs
    chosen = ConfidenceScheduler(curve).select({"a": [0.8, 0.8], "b": [0.95, 0.1]}, base_tokens=1, guaranteed=1)
    assert chosen == {"a": 1, "b": 1}


def test_ties_go_to_fewer_drafts():
    chosen = ConfidenceScheduler(StepLatencyCurve({1: 1.0, 2: 2.0, 3: 3.0})).select(
        {"a": [1.0, 1.0]}, base_tokens=1, guaranteed=1)
    assert chosen == {"a": 0}  # each draft costs exactly what it gives: (1 + n) / (1 + n)


def test_a_request_left_unverified_gets_a_probe_every_probe_every_steps():
    scheduler = ConfidenceScheduler(AFFINE, probe_every=3)
    picks = [scheduler.select({"a": [0.2, 0.2]}, base_tokens=1, guaranteed=1)["a"] for _ in range(7)]
    assert picks == [0, 0, 1, 0, 0, 1, 0]


def test_without_a_curve_every_draft_is_verified():
    chosen = ConfidenceScheduler(StepLatencyCurve()).select({"a": [0.1]}, base_tokens=1, guaranteed=1)
    assert chosen == {"a": 1}


PADS = DecodePadding(max_seqs=8, max_query_len=4)  # the runner pads decode steps of up to 8 sequences


def test_padded_steps_are_priced_at_sequences_times_the_longest_query():
    assert PADS.step_tokens([1, 4, 2]) == 12
    assert PADS.step_tokens([1, 9]) == 10  # a prompt chunk longer than any graph: its tokens
    assert PADS.step_tokens([2] * 9) == 18 and PADS.step_tokens([1] * 8 + [3]) == 11  # more sequences than graphs
    assert DecodePadding().step_tokens([1, 4]) == 5  # no graphs: nothing padded


def test_where_steps_are_padded_every_request_verifies_up_to_one_length():
    # unpadded, a's three drafts pay and b's none (above); padded, that step would cost as much as 2 x 4 tokens
    # (rate 4.44 / 5 = 0.89): one draft each does best, 3.2 / curve(4) = 1.07 against 4.1 / 5 at two
    confidences = {"a": [0.9, 0.9, 0.9], "b": [0.3, 0.3]}
    chosen = ConfidenceScheduler(AFFINE, padding=PADS).select(confidences, base_tokens=2, guaranteed=2)
    assert chosen == {"a": 1, "b": 1}
    # a request with fewer drafts than the length verifies all of its own
    chosen = ConfidenceScheduler(FLAT, padding=PADS).select({"a": [0.5, 0.5, 0.5], "b": [0.5]}, 2, 2)
    assert chosen == {"a": 3, "b": 1}


def test_steps_the_runner_does_not_pad_keep_the_token_pricing():
    confidences = {"a": [0.9, 0.9, 0.9], "b": [0.3, 0.3]}
    with_prompt = ConfidenceScheduler(AFFINE, padding=PADS).select(confidences, base_tokens=12, guaranteed=2)
    assert with_prompt == ConfidenceScheduler(AFFINE).select(confidences, base_tokens=12, guaranteed=2)
    small = DecodePadding(max_seqs=1, max_query_len=4)  # two sequences: more than its graphs hold
    assert ConfidenceScheduler(AFFINE, padding=small).select(confidences, 2, 2) == {"a": 3, "b": 0}


def test_a_probe_sets_the_least_length_of_a_padded_step():
    scheduler = ConfidenceScheduler(AFFINE, probe_every=1, padding=PADS)
    assert scheduler.select({"a": [0.05, 0.05], "b": [0.05]}, base_tokens=2, guaranteed=2) == {"a": 1, "b": 1}


def _scheduler(confidence):
    from dsinfer.config import SchedulerConfig
    from dsinfer.kvcache.manager import KVCacheManager
    from dsinfer.scheduler.scheduler import Scheduler

    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), KVCacheManager(64, 4, False),
                     max_model_len=128, confidence=confidence)


@pytest.mark.parametrize("curve,padding,expected", [(FLAT, DecodePadding(), [[7, 8, 9], [7, 8]]),
                                                    (AFFINE, DecodePadding(), [[7, 8], []]),
                                                    (AFFINE, PADS, [[7, 8], [7, 8]])])
def test_the_scheduler_verifies_the_prefix_the_confidence_scheduler_admits(curve, padding, expected):
    from dsinfer.core.plan import RequestSampling
    from dsinfer.core.request import Request

    scheduler = _scheduler(ConfidenceScheduler(curve, padding=padding))
    requests = []
    for i in range(2):
        sampling = RequestSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
        request = Request(f"r{i}", [1, 2, 3], params=None, seed=0, max_tokens=16, sampling=sampling)
        scheduler.add_request(request)
        requests.append(request)
    scheduler.schedule()  # the prompts
    for request in requests:
        request.append_token(4)
    requests[0].draft_token_ids, requests[0].draft_confidence = [7, 8, 9], [0.95, 0.95, 0.3]
    requests[1].draft_token_ids, requests[1].draft_confidence = [7, 8], [0.4, 0.95]
    out = scheduler.schedule()
    assert [item.draft_token_ids for item in out.scheduled] == expected
    assert [item.num_new_tokens for item in out.scheduled] == [1 + len(d) for d in expected]


def test_an_over_confident_drafter_is_scaled_down_by_position():
    from dsinfer.spec_decode.calibration import ScaledCalibrator

    calibrator = ScaledCalibrator(2, prior_weight=1.0)
    counts = calibrator.new_request()
    for _ in range(30):  # says 0.9 at both positions; the first is kept half the time, the second never reached
        calibrator.observe(counts, [0.9, 0.9], 2, 0)
        calibrator.observe(counts, [0.9, 0.9], 2, 1)
    first, second = calibrator.calibrated(counts, [0.9, 0.9])
    assert first == pytest.approx(0.9 * (30 + 1) / (54 + 1), rel=0.05)  # kept 30 of 60 reached, predicted 54
    assert second < 0.1  # reached 30 times, never kept
    # a new request takes the drafter-wide factors: (kept + 1) / (predicted + 1), position 1 reached 30 times
    # (predicted 27) and never kept; a position past the calibrated ones keeps its confidence
    assert calibrator.calibrated(calibrator.new_request(), [0.9, 0.2, 0.7]) == pytest.approx(
        [0.9 * 31 / 55, 0.2 / 28, 0.7])


def test_mtp_drafts_carry_calibrated_confidence():
    from dsinfer.core.plan import RequestSampling
    from dsinfer.core.request import Request
    from dsinfer.spec_decode.mtp import MTPDrafter

    sampling = RequestSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
    request = Request("r", [1, 2, 3], params=None, seed=0, max_tokens=64, sampling=sampling)
    drafter = MTPDrafter(2)
    drafter.receive(request, [5, 6], [0.8, 0.8])
    assert drafter.propose(request, 2).confidence == pytest.approx([0.8, 0.8])  # nothing observed yet
    for _ in range(20):
        drafter.observe(request, 2, 0)  # the first draft always rejected
        drafter.receive(request, [5, 6], [0.8, 0.8])
        drafter.propose(request, 2)
    drafter.receive(request, [5, 6], [0.8, 0.8])
    assert drafter.propose(request, 2).confidence[0] < 0.2
