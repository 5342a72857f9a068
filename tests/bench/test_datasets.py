"""The prompts and arrival times of ``dsinfer bench serve``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsinfer.bench.datasets import MIN_TOKEN_ID, jsonl_requests, random_requests, shared_prefix_requests
from dsinfer.bench.metrics import RequestResult, meets_slos, parse_goodput
from dsinfer.bench.serve import arrival_gaps


def test_random_prompts_are_seeded_and_lengths_follow_the_range_ratio():
    a = random_requests(50, 100, 20, vocab_size=1000, seed=3, range_ratio=0.5, prefix_len=7)
    assert a == random_requests(50, 100, 20, vocab_size=1000, seed=3, range_ratio=0.5, prefix_len=7)
    assert all(57 <= r.prompt_len <= 157 and 10 <= r.output_len <= 30 for r in a)
    assert len({r.prompt_len for r in a}) > 10
    assert all(r.prompt[:7] == a[0].prompt[:7] for r in a)
    assert all(MIN_TOKEN_ID <= t < 1000 for r in a for t in r.prompt)


def test_shared_prefix_prompts_cycle_through_their_prefixes():
    reqs = shared_prefix_requests(6, num_prefixes=2, prefix_len=5, suffix_len=3, output_len=4, vocab_size=500)
    assert [r.prompt_len for r in reqs] == [8] * 6
    assert reqs[0].prompt[:5] == reqs[2].prompt[:5] == reqs[4].prompt[:5] != reqs[1].prompt[:5]
    assert reqs[0].prompt[5:] != reqs[2].prompt[5:]


def test_jsonl_requests_take_text_ids_and_conversations(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hi"}, {"prompt_token_ids": [5, 6, 7], "output_len": 3},
            {"messages": [{"role": "user", "content": "yo"}]}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    reqs = jsonl_requests(path, 4, output_len=9)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs[:2]] == [("hi", 0, 9), ([5, 6, 7], 3, 3)]
    assert reqs[2].messages == rows[2]["messages"] and reqs[3].prompt == "hi"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1: expected 'prompt', 'prompt_token_ids' or 'messages'"):
        jsonl_requests(path, 1, 9)


def test_arrival_gaps_have_mean_one_over_rate_and_burstiness_widens_them():
    poisson = arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=0)
    bursty = arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=0)
    assert poisson.mean() == pytest.approx(0.25, rel=0.03) and bursty.mean() == pytest.approx(0.25, rel=0.05)
    # gamma(k, 1 / (rate k)): variance 1 / (rate^2 k)
    assert poisson.var() == pytest.approx(1 / 16, rel=0.05) and bursty.var() == pytest.approx(4 / 16, rel=0.1)
    assert not arrival_gaps(3, float("inf"), 1.0, 0).any()
    with pytest.raises(ValueError, match="--burstiness must be positive"):
        arrival_gaps(3, 1.0, 0.0, 0)


def test_goodput_counts_requests_within_every_slo():
    slos = parse_goodput(["ttft:100", "tpot:20"])
    assert slos == {"ttft": 100.0, "tpot": 20.0}
    fast = RequestResult(success=True, output_len=11, ttft=0.05, e2el=0.05 + 10 * 0.019)
    slow = RequestResult(success=True, output_len=11, ttft=0.05, e2el=0.05 + 10 * 0.021)
    assert meets_slos(fast, slos) and not meets_slos(slow, slos)
    assert not meets_slos(RequestResult(success=False), {})
    assert np.isclose(fast.tpot, 0.019)
