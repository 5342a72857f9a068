"""Deterministic mode for DeepSeek (MLA + MoE): a seeded (T=0.8) and a greedy request give identical token ids and
logprobs alone, among random companions (random batch positions), with chunked prefill on or off, on a prefix-cache
hit and after a preemption (generated tokens recomputed as prefill); greedy still matches transformers.

Tiny fp32 DeepSeek-V2 / V3 checkpoints are written by transformers with the builders of
``tests/models/test_deepseek.py``. The ops tests check the invariant MLA (one absorbed recipe for prefill, chunk and
decode rows) and MoE (top-k pairs summed in expert-id order) directly, on the torch path and through Triton.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.batch_invariant import batch_invariant
from dsinfer.batch_invariant.mla import latent_attention, mla_attention_invariant
from dsinfer.batch_invariant.moe import fused_moe_invariant
from dsinfer.ops.mla import mla_prefill_ref
from dsinfer.ops.moe import Routing, fused_moe_ref, select_experts
from tests.models.test_deepseek import hub_style_config, randomize, transformers, v2_config, v3_config

HAS_CUDA = torch.cuda.is_available()
TARGET_LEN, NEW = 40, 16


def _fingerprint(output):
    c = output.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)


def _ours():
    return [SamplingParams(temperature=0.8, seed=7, max_tokens=NEW, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3)]


def _companions(rng, n):
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(1, 64))]} for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 16), ignore_eos=True) for _ in range(n)]
    return prompts, params


def _run(llm, target, rng, num_companions, split=None):
    """(seeded, greedy) fingerprints of the target among ``num_companions`` random requests at a random place."""
    prompts, params = _companions(rng, num_companions)
    split = rng.randrange(num_companions + 1) if split is None else split
    outs = llm.generate(prompts[:split] + [{"prompt_token_ids": target}] * 2 + prompts[split:],
                        params[:split] + _ours() + params[split:], use_tqdm=False)
    return _fingerprint(outs[split]), _fingerprint(outs[split + 1])


def _build(arch, path):
    torch.manual_seed(0)
    if arch == "v2":
        hf = transformers.DeepseekV2ForCausalLM(v2_config()).eval()
        randomize(hf, seed=1)
        hf.save_pretrained(path)
        hub_style_config(path)
    else:
        hf = transformers.DeepseekV3ForCausalLM(v3_config()).eval()
        randomize(hf, seed=2)
        hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def v2_ckpt(tmp_path_factory):
    return _build("v2", tmp_path_factory.mktemp("det-deepseek-v2"))


@pytest.fixture(scope="module")
def v3_ckpt(tmp_path_factory):
    return _build("v3", tmp_path_factory.mktemp("det-deepseek-v3"))


def _target(seed):
    rng = random.Random(seed)
    return rng, [rng.randrange(256) for _ in range(TARGET_LEN)]


@pytest.mark.parametrize("arch,chunked,cache", [("v2", True, "auto"), ("v3", False, "auto"), ("v2", True, "fp8")])
def test_outputs_identical_alone_and_in_batches(request, arch, chunked, cache):
    path, _ = request.getfixturevalue(f"{arch}_ckpt")
    kwargs = dict(max_num_batched_tokens=48) if chunked else dict(enable_chunked_prefill=False)
    llm = LLM(str(path), dtype="float32", deterministic=True, kv_cache_dtype=cache, **kwargs)
    rng, target = _target(0)
    results = {_run(llm, target, rng, k) for k in (0, 1, 9, 64)}
    assert len(results) == 1
    # prefix-cache hit: the target prompt is cached by now
    (hit,) = llm.generate([{"prompt_token_ids": target}], _ours()[1], use_tqdm=False)
    assert hit.num_cached_tokens > 0
    assert _fingerprint(hit) == next(iter(results))[1]


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_chunking_prefix_cache_preemption_agree_and_greedy_matches_hf(request, arch):
    path, hf = request.getfixturevalue(f"{arch}_ckpt")
    rng, target = _target(1)
    results = []
    for kwargs in (dict(max_num_batched_tokens=16), dict(enable_chunked_prefill=False),
                   dict(enable_prefix_caching=False)):
        llm = LLM(str(path), dtype="float32", deterministic=True, **kwargs)
        results.append(_run(llm, target, rng, 0))
    # preemption: the target requests come last (the scheduler preempts the newest) in a cache of 10 blocks
    llm = LLM(str(path), dtype="float32", deterministic=True, num_kv_blocks=10, enable_prefix_caching=False)
    scheduler, victims = llm.engine.scheduler, []
    original = scheduler._preempt
    scheduler._preempt = lambda req: (victims.append(list(req.prompt_token_ids)), original(req))
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(40)]} for _ in range(4)]
    companion = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    results.append(_run_fixed(llm, prompts, [companion] * 4, target))
    assert target in victims, "the target was never preempted"
    assert len(set(results)) == 1
    with torch.no_grad():
        ids = torch.tensor([target])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)
    assert list(results[0][1][0]) == ref[0, TARGET_LEN:].tolist()


def _run_fixed(llm, prompts, params, target):
    outs = llm.generate(prompts + [{"prompt_token_ids": target}] * 2, params + _ours(), use_tqdm=False)
    return _fingerprint(outs[-2]), _fingerprint(outs[-1])


# ---- ops ----


def _mla_case(seed=0, heads=4, nope=16, rope=8, rank=32, v_dim=16, block_size=4):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(48, block_size, rank + rope, generator=gen)
    w_kv_b = torch.randn(heads, nope + v_dim, rank, generator=gen) / rank**0.5
    q_nope = torch.randn(24, heads, nope, generator=gen)
    q_pe = torch.randn(24, heads, rope, generator=gen)
    return cache, w_kv_b, q_nope, q_pe


def _meta(tables, q_lens, seq_lens):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return bt, qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("use_triton", [False, True])
def test_mla_row_same_in_prefill_chunk_decode_batch_and_alone(use_triton):
    if use_triton:
        pytest.importorskip("triton")
    dev = "cuda" if HAS_CUDA and use_triton else "cpu"  # the torch recipe is the CPU path
    cache, w_kv_b, q_nope, q_pe = (t.to(dev) for t in _mla_case())
    table_a, table_b = list(range(0, 10)), list(range(10, 48))

    def call(qn, qp, tables, q_lens, seq_lens):
        bt, qsl, sl = (t.to(dev) for t in _meta(tables, q_lens, seq_lens))
        return mla_attention_invariant(qn, qp, cache, bt, qsl, sl, w_kv_b, 0.3, use_triton=use_triton)

    # sequence A: a chunk of 20 query rows ending at position 37 (context 38)
    chunk = call(q_nope[:20], q_pe[:20], [table_a], [20], [38])
    alone = call(q_nope[19:20], q_pe[19:20], [table_a], [1], [38])
    # the same row as a decode next to a longer companion, and inside a chunk of a mixed batch
    batched = call(torch.cat((q_nope[20:21], q_nope[19:20])), torch.cat((q_pe[20:21], q_pe[19:20])),
                   [table_b, table_a], [1, 1], [150, 38])
    mixed = call(torch.cat((q_nope[20:24], q_nope[15:20])), torch.cat((q_pe[20:24], q_pe[15:20])),
                 [table_b, table_a], [4, 5], [140, 38])
    assert torch.equal(alone[0], chunk[-1])
    assert torch.equal(batched[1], chunk[-1])
    assert torch.equal(mixed[-1], chunk[-1])
    bt, qsl, sl = _meta([table_a], [20], [38])
    ref = mla_prefill_ref(q_nope[:20].cpu(), q_pe[:20].cpu(), cache.cpu(), bt, qsl, sl, w_kv_b.cpu(), 0.3)
    torch.testing.assert_close(chunk.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_latent_attention_long_chunks_over_many_rows():
    """More than one CHUNK of keys and more than 256 score rows (the row-chunked matmul path) stay invariant."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(64, 4, 40, generator=gen)
    q_abs, q_pe = torch.randn(90, 4, 32, generator=gen), torch.randn(90, 4, 8, generator=gen)
    bt, qsl, sl = _meta([list(range(64))], [90], [200])
    full = latent_attention(q_abs, q_pe, cache, bt, qsl, sl, 0.2)
    for row in (0, 63, 89):
        bt1, qsl1, sl1 = _meta([list(range(64))], [1], [200 - 89 + row])
        one = latent_attention(q_abs[row:row + 1], q_pe[row:row + 1], cache, bt1, qsl1, sl1, 0.2)
        assert torch.equal(one[0], full[row])


@pytest.mark.parametrize("use_triton", [False, True])
def test_moe_token_same_alone_and_in_batch(use_triton):
    if use_triton:
        pytest.importorskip("triton")
    dev = "cuda" if HAS_CUDA and use_triton else "cpu"
    gen = torch.Generator().manual_seed(2)
    num_experts, hidden, inter = 8, 64, 32
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dev)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dev)
    x = torch.randn(37, hidden, generator=gen).to(dev)
    logits = torch.randn(37, num_experts, generator=gen).to(dev)
    with batch_invariant():
        weights, ids = select_experts(logits, 3, Routing("sigmoid", norm_topk_prob=True))
        assert bool((ids[:, 1:] > ids[:, :-1]).all())  # expert-id order
        one_w, one_ids = select_experts(logits[5:6], 3, Routing("sigmoid", norm_topk_prob=True))
        assert torch.equal(one_w[0], weights[5]) and torch.equal(one_ids[0], ids[5])
        full = fused_moe_invariant(x, w13, w2, weights, ids, use_triton=use_triton)
        for rows in (slice(5, 6), slice(0, 3), slice(20, 37)):
            part = fused_moe_invariant(x[rows], w13, w2, weights[rows], ids[rows], use_triton=use_triton)
            assert torch.equal(part, full[rows])
    ref = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(full.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_gpu_hundred_runs_with_random_companions_one_output(request, arch):
    path, _ = request.getfixturevalue(f"{arch}_ckpt")
    llm = LLM(str(path), dtype="bfloat16", deterministic=True, device="cuda", max_num_batched_tokens=256)
    rng, target = _target(3)
    results = {_run(llm, target, rng, rng.randrange(0, 65)) for _ in range(100)}
    assert len(results) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_gpu_decode_graphs_replay_the_invariant_kernels(request, arch):
    """Deterministic mode keeps CUDA graphs (captured inside the invariant mode): graph replays give the very
    tokens and logprobs of eager steps, alone and among companions."""
    path, _ = request.getfixturevalue(f"{arch}_ckpt")
    graphed = LLM(str(path), dtype="bfloat16", deterministic=True, device="cuda")
    assert graphed.engine.runner.graphs is not None and graphed.engine.runner.graphs.graphs, "no graph captured"
    eager = LLM(str(path), dtype="bfloat16", deterministic=True, device="cuda", enforce_eager=True)
    rng, target = _target(4)
    results = {_run(llm, target, rng, k) for llm in (graphed, eager) for k in (0, 5, 33)}
    assert len(results) == 1
