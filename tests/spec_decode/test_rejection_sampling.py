"""Rejection-sampling verification (``acceptance="rejection"``, q one-hot on the draft): a verifying row's token
is distributed as the target's p, with every sampling rule applied to p as without speculation. Checked by
chi-square, at a fixed budget: on the Sampler directly (many rows, one call) and through the engine on the first
generated tokens (the full >= 2,000-trial run is ``benchmarks/spec_decode_lossless.py``)."""

from __future__ import annotations

import torch

from dsinfer import LLM, SamplingParams
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.sampling.sampler import Sampler, SamplingBatch

V = 32


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit of counts against expected counts; cells expected below ``min_expected`` pooled."""
    keep = expected >= min_expected
    obs = torch.cat([observed[keep], observed[~keep].sum().reshape(1)]).double()
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)]).double()
    if exp[-1] < min_expected:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), stat / 2))


def two_sample_p(a: torch.Tensor, b: torch.Tensor, min_expected: float = 5.0) -> float:
    """Homogeneity of two count vectors (equal totals): each against their pooled mean."""
    pooled = (a + b).double() / 2
    keep = pooled >= min_expected
    a, b, pooled = a[keep].double(), b[keep].double(), pooled[keep]
    stat = (((a - pooled) ** 2 + (b - pooled) ** 2) / pooled).sum()
    return float(torch.special.gammaincc(torch.tensor((len(pooled) - 1) / 2.0), stat / 2))


def _batch(rows: int, logits: torch.Tensor, draft: int | None, seed0: int,
           **extra) -> tuple[torch.Tensor, SamplingBatch]:
    return logits.expand(rows, V).clone(), SamplingBatch(
        temperature=torch.full((rows,), 0.7), top_k=torch.full((rows,), 20, dtype=torch.int64),
        top_p=torch.full((rows,), 0.9), min_p=torch.full((rows,), 0.02),
        seeds=torch.arange(seed0, seed0 + rows, dtype=torch.int64), positions=torch.full((rows,), 9, dtype=torch.int64),
        all_greedy=False, use_top_k=True, max_top_k=20, use_top_p=True, use_min_p=True,
        draft_ids=None if draft is None else torch.full((rows,), draft, dtype=torch.int64), **extra)


LOGITS = 2.0 * torch.randn(1, V, generator=torch.Generator().manual_seed(3))


def test_a_kept_or_resampled_draft_is_distributed_as_the_target():
    rows = 20_000
    likely = int(LOGITS.argmax())
    for draft in (likely, int(LOGITS.argsort(descending=True)[0, 1])):  # often kept / mostly resampled
        logits, batch = _batch(rows, LOGITS, draft, seed0=0)
        tokens = Sampler()(logits, batch).token_ids
        # the target's p: what the same rows sample without a draft, counted on other seeds
        plain_logits, plain = _batch(rows, LOGITS, None, seed0=10 * rows)
        reference = Sampler()(plain_logits, plain).token_ids
        counts, expected = torch.bincount(tokens, minlength=V), torch.bincount(reference, minlength=V)
        assert two_sample_p(counts, expected) > 1e-3
        kept = int((tokens == draft).sum())
        assert 0 < kept < rows


def test_every_sampling_rule_applies_to_p_as_without_a_draft():
    rows = 20_000
    bias = torch.zeros(rows, V)
    bias[:, 5] = 3.0
    banned = torch.zeros(rows, V, dtype=torch.bool)
    banned[:, int(LOGITS.argmax())] = True  # the most likely token, e.g. a min_tokens ban
    extra = dict(logit_bias=bias, banned=banned)
    logits, batch = _batch(rows, LOGITS, 5, seed0=0, **extra)
    tokens = Sampler()(logits, batch).token_ids
    plain_logits, plain = _batch(rows, LOGITS, None, seed0=10 * rows, **extra)
    reference = Sampler()(plain_logits, plain).token_ids
    assert not (tokens == int(LOGITS.argmax())).any()
    assert two_sample_p(torch.bincount(tokens, minlength=V), torch.bincount(reference, minlength=V)) > 1e-3


def test_a_draft_outside_the_filtered_set_is_never_kept():
    logits, batch = _batch(2000, LOGITS, int(LOGITS.argmin()), seed0=0)
    assert not (Sampler()(logits, batch).token_ids == int(LOGITS.argmin())).any()


class FixedDrafter:
    """Proposes the same tokens after every output: q one-hot, independent of the sampling noise."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, request, num_tokens):
        return self.tokens[:num_tokens]


# A random tiny model's next-token distribution is nearly flat over 256 tokens: the requests sample among 8
# allowed tokens whose logit biases shape a distribution the trials can resolve (allowed_token_ids, logit_bias,
# temperature and top-p all act on p)
ALLOWED = list(range(20, 28))
BIAS = {20: 2.0, 21: 1.5, 22: 1.0, 23: 0.6, 24: 0.3}


def first_tokens(llm: LLM, prompt: list[int], trials: int, seed0: int) -> list[list[int]]:
    # 4 tokens: the step after the first verifies 2 drafts (never more than the outputs still allowed, less one)
    params = [SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=seed0 + i, ignore_eos=True,
                             allowed_token_ids=ALLOWED, logit_bias=BIAS) for i in range(trials)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * trials, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids[:3]) for o in outs]


def test_engine_first_tokens_match_sampling_without_speculation(tiny_llama_dir):
    """The 2nd and 3rd generated tokens come from verifying steps (drafts kept with p(d) or resampled)."""
    prompt, trials = [11, 12, 13, 14, 11, 12, 13], 400
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=2048, max_num_seqs=trials, enable_prefix_caching=False)
    reference = first_tokens(plain, prompt, trials, seed0=10_000)
    spec = LLM(str(tiny_llama_dir), num_kv_blocks=2048, max_num_seqs=trials, enable_prefix_caching=False,
               speculative_config={"num_speculative_tokens": 2, "acceptance": "rejection"})
    spec.engine = LLMEngine(spec.engine.config, spec.engine.tokenizer, drafter=FixedDrafter([20, 21]))
    got = first_tokens(spec, prompt, trials, seed0=0)
    stats = spec.engine.get_stats()["spec_decode"]
    assert stats["num_draft_tokens"] >= 2 * trials
    assert trials / 4 < stats["num_accepted_tokens"] < stats["num_draft_tokens"] - trials / 4  # kept and rejected
    for position in range(3):
        a = torch.bincount(torch.tensor([t[position] for t in got]), minlength=256)
        b = torch.bincount(torch.tensor([t[position] for t in reference]), minlength=256)
        assert two_sample_p(a, b) > 1e-3, position
    joint = {}
    for tokens in got + reference:
        joint.setdefault(tuple(tokens), [0, 0])
    for tokens in got:
        joint[tuple(tokens)][0] += 1
    for tokens in reference:
        joint[tuple(tokens)][1] += 1
    counts = torch.tensor(list(joint.values()))
    assert two_sample_p(counts[:, 0], counts[:, 1]) > 1e-3  # the three tokens together
