"""Sampling: batch-invariant seeded draws; the Sampler's filters and penalties on built logits; the noise."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.core.request import Request
from dsinfer.ops.noise import uniform_noise
from dsinfer.runner.input_batch import SampleRow, build_sampling_batch
from dsinfer.runner.request_table import RequestTable
from dsinfer.sampling.sampler import Penalties, Sampler, SamplingBatch, apply_penalties
from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

V = 64


def make_batch(rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed0=0, position=0, **extra):
    """A SamplingBatch of `rows` rows with consecutive seeds, as build_sampling_batch would make it."""
    temp = torch.full((rows,), float(temperature))
    k = torch.full((rows,), V if top_k < 0 else top_k, dtype=torch.int64)
    return SamplingBatch(
        temperature=temp, top_k=k,
        top_p=torch.full((rows,), float(top_p)), min_p=torch.full((rows,), float(min_p)),
        seeds=torch.arange(seed0, seed0 + rows, dtype=torch.int64),
        positions=torch.full((rows,), position, dtype=torch.int64),
        all_greedy=temperature == 0, use_top_k=top_k > 0, use_top_p=top_p < 1.0, use_min_p=min_p > 0.0,
        max_top_k=int(k.max()), **extra)


def random_logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------- batch invariance through the engine
def test_seeded_request_is_identical_alone_and_in_a_random_batch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    target_prompt = {"prompt_token_ids": list(range(30, 70))}
    target = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    (alone,) = llm.generate(target_prompt, target, use_tqdm=False)
    rng = random.Random(5)
    prompts, params = [], []
    for i in range(16):
        prompts.append({"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(3, 90))]})
        params.append(SamplingParams(
            max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 0.5, 1.0, 1.3]),
            top_p=rng.choice([1.0, 0.7]), top_k=rng.choice([-1, 5, 50]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.2]), frequency_penalty=rng.choice([0.0, 0.5]),
            seed=rng.choice([None, i]), logprobs=rng.choice([None, 2]), ignore_eos=True))
    prompts.insert(7, target_prompt)
    params.insert(7, target)
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone.outputs[0].token_ids
    (again,) = llm.generate(target_prompt, target, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_greedy_matches_transformers_generate(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    prompt = [random.Random(2).randrange(256) for _ in range(25)]
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    (out,) = LLM(str(tiny_llama_dir)).generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        use_tqdm=False)
    assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()


# ----------------------------------------------------------------- the Sampler on constructed logits
def test_greedy_equals_argmax():
    logits = random_logits(16)
    out = Sampler()(logits, make_batch(16, temperature=0.0))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_16bit_logits_sample_like_their_float32_upcast():
    """The decode graphs hand the sampler bf16 logits: plain greedy takes their argmax as they are (ties
    included: the first maximum), anything else upcasts first, so every token and logprob equals the float32
    path's."""
    logits = random_logits(32, seed=7).bfloat16()
    logits[3, 10] = logits[3, 40] = logits[3].max() + 1  # a tie: both paths must pick index 10
    upcast = logits.float()
    greedy = Sampler()(logits, make_batch(32, temperature=0.0))
    assert torch.equal(greedy.token_ids, upcast.argmax(-1)) and greedy.token_ids[3] == 10
    for batch in (make_batch(32, temperature=0.0, num_logprobs=3), make_batch(32, temperature=0.7, top_p=0.9)):
        out, ref = Sampler()(logits, batch), Sampler()(upcast, batch)
        assert torch.equal(out.token_ids, ref.token_ids)
        if batch.num_logprobs is not None:
            assert out.logprobs.dtype == torch.float32 and torch.equal(out.logprobs, ref.logprobs)


def test_greedy_rows_in_a_sampled_batch_take_the_argmax():
    logits = random_logits(8, seed=1)
    batch = make_batch(8, temperature=1.0)
    batch.temperature[::2] = 0.0
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids[::2], logits[::2].argmax(-1))


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_leaves_the_k_most_likely(k):
    logits = random_logits(1, seed=k).expand(500, V)
    out = Sampler()(logits, make_batch(500, temperature=1.5, top_k=k))
    allowed = set(logits[0].topk(k).indices.tolist())
    assert set(out.token_ids.tolist()) <= allowed
    assert len(set(out.token_ids.tolist())) == k  # with 500 seeds every allowed token shows up


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.85])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p):
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1] + [0.1 / (V - 4)] * (V - 4), dtype=torch.float64)
    logits = probs.log().float().unsqueeze(0).expand(500, V)
    out = Sampler()(logits, make_batch(500, temperature=1.0, top_p=top_p))
    before = (probs.cumsum(0) - probs).tolist()  # mass of the more likely tokens
    allowed = {i for i, mass in enumerate(before) if mass < top_p}
    assert set(out.token_ids.tolist()) == allowed


def test_top_p_filters_the_temperature_scaled_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [1e-9] * (V - 3), dtype=torch.float64)
    logits = probs.log().float().unsqueeze(0).expand(400, V)
    # at T = 0.25 token 0 holds ~0.87 of the mass, so top_p = 0.8 keeps it alone
    out = Sampler()(logits, make_batch(400, temperature=0.25, top_p=0.8))
    assert set(out.token_ids.tolist()) == {0}


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.8])
def test_min_p_drops_tokens_below_min_p_times_the_top(min_p):
    logits = random_logits(1, seed=11, scale=1.5).expand(500, V)
    out = Sampler()(logits, make_batch(500, temperature=1.0, min_p=min_p))
    probs = logits[0].double().softmax(-1)
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    assert set(out.token_ids.tolist()) <= allowed and len(set(out.token_ids.tolist())) > 0


def test_filters_combine_in_one_batch():
    logits = random_logits(1, seed=4).expand(300, V).contiguous()
    batch = make_batch(300, temperature=1.0)
    batch.top_k[:100] = 2
    batch.top_p[100:200] = 0.2
    batch.min_p[200:] = 0.5
    batch.use_top_k = batch.use_top_p = batch.use_min_p = True
    out = Sampler()(logits, batch).token_ids
    probs = logits[0].double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    assert set(out[:100].tolist()) <= set(order[:2])
    before = (probs[order].cumsum(0) - probs[order]).tolist()
    assert set(out[100:200].tolist()) <= {t for t, m in zip(order, before) if m < 0.2}
    assert set(out[200:].tolist()) <= set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())


def test_sampled_frequencies_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1] + [1e-12] * (V - 4), dtype=torch.float64)
    n = 20000
    logits = (probs.log() * 0.5).float().unsqueeze(0).expand(n, V)  # T = 0.5 undoes the 0.5 scale
    batch = make_batch(n, temperature=0.5)
    batch.positions = torch.arange(n, dtype=torch.int64)
    counts = torch.bincount(Sampler()(logits, batch).token_ids, minlength=V).double() / n
    assert torch.allclose(counts[:4], probs[:4], atol=0.015)


def test_banned_mask_is_respected():
    """Everything outside 10..19 banned (as allowed_token_ids bans), and every row's argmax too."""
    logits = random_logits(200, seed=6)
    banned = torch.ones(200, V, dtype=torch.bool)
    banned[:, 10:20] = False
    banned[:, logits.argmax(-1)] = True
    out = Sampler()(logits, make_batch(200, temperature=2.0, banned=banned)).token_ids
    assert ((out >= 10) & (out < 20)).all() and not banned.gather(1, out.unsqueeze(1)).any()


def test_logit_bias_is_added_before_sampling():
    logits = random_logits(4, seed=8)
    bias = torch.zeros(4, V)
    bias[:, 33] = 100.0
    out = Sampler()(logits, make_batch(4, temperature=0.0, logit_bias=bias, num_logprobs=1))
    assert out.token_ids.tolist() == [33] * 4
    # logprobs are those of the raw logits, as in vLLM
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs[:, 0], raw[:, 33])
    assert torch.equal(out.sampled_ranks, (raw > raw[:, 33:34]).sum(-1) + 1)


def test_penalties_change_logits_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    prompt_mask = torch.tensor([[True, True, False, False, False, False]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 1.0, 0.0, 0.0]])
    p = Penalties(repetition=torch.tensor([2.0]), presence=torch.tensor([0.5]),
                  frequency=torch.tensor([0.25]), output_counts=counts, prompt_mask=prompt_mask)
    out = apply_penalties(logits, p)
    expected = [
        2.0 / 2,  # prompt token, positive: divided by the repetition penalty
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - 0.25 * 2 - 0.5,  # output token seen twice: repetition, frequency x count, presence
        -0.5 * 2 - 0.25 * 1 - 0.5,
        3.0, 1.0,  # never seen: untouched
    ]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_runner_builds_penalties_from_prompt_and_output_tokens():
    request = Request("r", [1, 2, 2, 3], SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5,
                                                        presence_penalty=-0.5, logit_bias={7: 2.0}), 0, 8)
    for token in (3, 5, 5):
        request.append_token(token)
    plan = standalone_output([ScheduledRequest(request, 1, request.num_tokens - 1)]).plan
    (state,) = RequestTable().apply(plan)  # the worker's copy of the request, made from the plan alone
    batch = build_sampling_batch([SampleRow(state, request.num_tokens, [], None)], V, torch.device("cpu"))
    pen = batch.penalties
    assert pen.prompt_mask[0].nonzero().flatten().tolist() == [1, 2, 3]
    assert pen.output_counts[0, [3, 5]].tolist() == [1.0, 2.0] and pen.output_counts.sum() == 3
    assert (pen.repetition.item(), pen.frequency.item(), pen.presence.item()) == (1.5, 0.5, -0.5)
    assert batch.logit_bias[0, 7] == 2.0 and batch.logit_bias.abs().sum() == 2.0
    assert batch.positions.tolist() == [7] and batch.seeds.tolist() == [0]


def test_penalties_steer_generation_away_from_repeats(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    prompt = {"prompt_token_ids": [9] * 8}
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logit_bias={9: 5.0})
    (plain,) = llm.generate(prompt, params, use_tqdm=False)
    assert set(plain.outputs[0].token_ids) == {9}
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=2.0, repetition_penalty=100.0)
    (penalized,) = llm.generate(prompt, params, use_tqdm=False)
    tokens = penalized.outputs[0].token_ids
    assert 9 not in tokens and len(set(tokens)) == len(tokens)


# ----------------------------------------------------------------- the noise
def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _uniform_reference(seed: int, pos: int, token: int) -> float:
    """The formula in ops/noise.py's docstring, in plain Python integers."""
    seed &= (1 << 64) - 1
    inner = _lowbias32((seed >> 32) ^ _lowbias32((pos & 0xFFFFFFFF) ^ 0x9E3779B9))
    key = _lowbias32((seed & 0xFFFFFFFF) ^ inner)
    bits = _lowbias32(key ^ _lowbias32(token + 0x632BE5AB))
    return ((bits >> 9) + 0.5) / 2**23


def test_noise_matches_its_documented_formula():
    cases = [(0, 0), (1, 5), (-1, 7), (2**63 - 1, 2**40), (-(2**63), 3), (123456789, 1000)]
    seeds = torch.tensor([s for s, _ in cases], dtype=torch.int64)
    positions = torch.tensor([p for _, p in cases], dtype=torch.int64)
    noise = uniform_noise(seeds, positions, 300)
    for row, (seed, pos) in enumerate(cases):
        for token in (0, 1, 17, 299):
            assert noise[row, token].item() == _uniform_reference(seed, pos, token)


def test_noise_is_in_the_open_unit_interval():
    seeds, positions = torch.arange(-500, 500, dtype=torch.int64), torch.arange(1000, dtype=torch.int64)
    noise = uniform_noise(seeds, positions, 4096)
    assert noise.dtype == torch.float32
    assert noise.min().item() > 0.0 and noise.max().item() < 1.0
    assert abs(noise.mean().item() - 0.5) < 1e-3


def test_noise_is_a_pure_function_of_seed_position_and_token():
    seeds = torch.tensor([3, 3, 4, -9], dtype=torch.int64)
    positions = torch.tensor([10, 11, 10, 10], dtype=torch.int64)
    batch = uniform_noise(seeds, positions, 1000)
    for row in range(4):
        alone = uniform_noise(seeds[row:row + 1], positions[row:row + 1], 1000)
        assert torch.equal(alone[0], batch[row])
    assert torch.equal(uniform_noise(seeds, positions, 100), batch[:, :100])  # the vocab size does not matter
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[0], batch[2])
    assert not math.isclose(batch[0, 0].item(), batch[0, 1].item())
