"""Multi-token steps: a step verifies a request's draft tokens (1 + k tokens scheduled), keeps the drafts the model
agrees with and rolls the rest back. A drafter stand-in proposes known tokens (the one-token run's own outputs,
some of them spoiled), so the outputs must be exactly those of one-token steps, and the KV blocks of rejected
drafts must go back."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.config import SpeculativeConfig
from dsinfer.core.request import Request
from dsinfer.engine.llm_engine import LLMEngine

K = 3


class KnownTokensDrafter:
    """Proposes the tokens a reference run produced after the request's current output, spoiling every
    ``spoil_every``-th proposal (so some drafts are rejected); records what it proposed."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], spoil_every: int = 0, vocab: int = 256):
        self.reference = reference
        self.spoil_every = spoil_every
        self.vocab = vocab
        self.proposed = 0

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        known = self.reference.get(tuple(request.prompt_token_ids), [])
        start = request.num_output_tokens
        drafts = list(known[start:start + num_tokens])
        for j in range(len(drafts)):
            if self.spoil_every and (start + j) % self.spoil_every == self.spoil_every - 1:
                drafts[j] = (drafts[j] + 1) % self.vocab
        self.proposed += len(drafts)
        return drafts


def with_drafter(llm: LLM, drafter, k: int = K) -> LLM:
    """The same model and settings with a drafter and k speculative tokens a step."""
    config = dataclasses.replace(llm.engine.config, speculative=SpeculativeConfig(k))
    llm.engine = LLMEngine(config, llm.engine.tokenizer, drafter=drafter)
    return llm


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


def run(llm: LLM, batch: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4)


@pytest.mark.parametrize("spoil_every", [0, 2, 3])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_outputs_identical_to_one_token_steps(tiny_llama_dir, plain, spoil_every, sampling):
    batch = prompts(6, seed=spoil_every)
    if sampling == "greedy":
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    else:
        params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
                  for i in range(len(batch))]
    expected = run(plain, batch, params)
    drafter = KnownTokensDrafter({tuple(p): out for p, out in zip(batch, expected)}, spoil_every)
    llm = with_drafter(LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=4), drafter)
    assert run(llm, batch, params) == expected
    assert drafter.proposed > 0
    engine = llm.engine
    assert engine.kv_manager.num_free_blocks == engine.runner.num_blocks - 1  # every block back, rejected or not


def test_accepted_drafts_take_fewer_steps(tiny_llama_dir, plain):
    batch = prompts(2, seed=7)
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    expected = run(plain, batch, params)
    llm = with_drafter(LLM(str(tiny_llama_dir)), KnownTokensDrafter({tuple(p): o for p, o in zip(batch, expected)}))
    for i, p in enumerate(batch):
        llm.engine.add_request(str(i), {"prompt_token_ids": p}, params)
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    # one prefill step, then 4 tokens a step (3 accepted drafts + the model's own): 12 more tokens in 3 steps
    assert steps == 4


def test_rejected_drafts_give_their_blocks_back(tiny_llama_dir, plain):
    (prompt,) = prompts(1, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (expected,) = run(plain, [prompt], params)
    wrong = KnownTokensDrafter({tuple(prompt): expected}, spoil_every=1)  # every draft spoiled
    llm = with_drafter(LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4), wrong, k=8)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt
    request = engine.scheduler.running[0]
    while engine.has_unfinished_requests():
        engine.step()
        if request.is_finished:
            break
        # after each step only the blocks of the computed tokens are held: the 8 drafts' are back in the pool
        assert len(request.blocks) == -(-request.num_computed_tokens // 4)
        assert request.num_computed_tokens == request.num_tokens - 1
    assert request.output_token_ids == expected
    assert engine.kv_manager.num_free_blocks == 63


def test_stops_apply_across_a_run_and_truncate_it(tiny_llama_dir, plain):
    batch = prompts(4, seed=11)
    base = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    free_run = run(plain, batch, base)
    stop_at = free_run[0][5]  # a token the first request samples mid-run: its run must end there
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),  # max_tokens inside a run
              SamplingParams(max_tokens=14, temperature=0.0, min_tokens=9, stop_token_ids=[free_run[2][1]]),
              SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)]
    expected = run(plain, batch, params)
    assert len(expected[0]) <= 6 and expected[0][-1] == stop_at and len(expected[1]) == 6
    llm = with_drafter(LLM(str(tiny_llama_dir)), KnownTokensDrafter({tuple(p): o for p, o in zip(batch, free_run)}),
                       k=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert outs[0].outputs[0].stop_reason == stop_at and outs[1].outputs[0].finish_reason == "length"


def test_logprobs_come_for_every_token_of_a_run(tiny_llama_dir, plain):
    batch = prompts(3, seed=5)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = plain.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    drafter = KnownTokensDrafter({tuple(p): list(o.outputs[0].token_ids) for p, o in zip(batch, ref)}, 3)
    llm = with_drafter(LLM(str(tiny_llama_dir)), drafter)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].logprobs) == len(want.outputs[0].logprobs) == 9
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for tid in a:
                assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)


def test_drafts_beyond_the_budget_are_dropped_not_split(tiny_llama_dir, plain):
    """A step's token budget counts the drafts: a request whose drafts do not fit runs one token."""
    batch = [[5, 6], [7, 8], [9, 10]]  # prefilled together in the first step
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = run(plain, batch, params)
    llm = with_drafter(LLM(str(tiny_llama_dir), max_num_batched_tokens=8, max_num_seqs=3),
                       KnownTokensDrafter({tuple(p): o for p, o in zip(batch, expected)}), k=4)
    seen = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        assert out.num_batched_tokens <= 8
        seen.append({(len(item.draft_token_ids), item.num_new_tokens) for item in out.scheduled})
        return out

    llm.engine.scheduler.schedule = recording
    assert run(llm, batch, params) == expected
    # some step verified one request's 4 drafts while another, whose drafts did not fit, decoded one token
    assert any({(4, 5), (0, 1)} <= step for step in seen)
