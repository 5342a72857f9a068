"""Sliding-window models through the KV cache groups, against transformers: a Mistral (every layer sliding: one
sliding group) and a Qwen2 whose first layer is full (a full group and a sliding one), window shorter than the
context. Greedy tokens equal HF ``generate``, prompt logprobs within 1e-4, through chunked prefill and prefix
hits, while the blocks a sequence holds in a sliding group stay bounded by the window."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams

from .hf_reference import hf_prompt_logprobs

transformers = pytest.importorskip("transformers")

WINDOW = 16
BLOCK = 16
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=["mistral", "qwen2-hybrid"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, sliding_window=WINDOW)
    if request.param == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
        assert config.layer_types == ["full_attention", "sliding_attention"]
        model = transformers.Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp(request.param)
    model.eval().save_pretrained(path)
    return request.param, path, model


def _prompts(vocab: int, lengths=(5, 21, 37, 50)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_generate(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, len(ids):].tolist()


def _track_blocks(llm) -> list[tuple[int, int]]:
    """(live blocks of the full groups, of the sliding groups) a request holds after each allocation."""
    kv, seen = llm.engine.kv_manager, []
    allocate = kv.allocate_slots

    def tracked(request, *args):
        ok = allocate(request, *args)
        lists = [request.blocks, *request.group_blocks]
        live = [sum(b.block_id != 0 for b in blocks) for blocks in lists]
        seen.append((sum(n for n, w in zip(live, kv.windows) if w is None),
                     sum(n for n, w in zip(live, kv.windows) if w is not None)))
        return ok

    kv.allocate_slots = tracked
    return seen


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_transformers_with_blocks_bounded(checkpoint, engine_kwargs):
    arch, path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, **engine_kwargs)
    seen = _track_blocks(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = 0.0
    for ids, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _hf_generate(model, ids), f"{arch}: greedy tokens differ"
        ours = torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])])
        worst = max(worst, (ours - hf_prompt_logprobs(model, ids)).abs().max().item())
    assert worst < 1e-4, f"{arch}: max |prompt logprob difference| = {worst:.2e}"
    # 90 tokens need 6 blocks in a full group; a sliding one holds its window, a chunk and one block of slack
    chunk = engine_kwargs.get("max_num_batched_tokens", 50)
    assert max(sliding for _, sliding in seen) <= -(-(WINDOW + chunk) // BLOCK) + 1
    assert seen[-1][1] <= WINDOW // BLOCK + 1
    assert max(full for full, _ in seen) == (6 if arch == "qwen2-hybrid" else 0)


def test_prefix_hits_keep_greedy_tokens(checkpoint):
    arch, path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)
    shared = [prompts[-1][:48] + ids for ids in prompts[:3]]  # 48 tokens (3 blocks) cached by the first request
    outputs = llm.generate([{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [48, 48, 48]
    assert [o.outputs[0].token_ids for o in outputs] == [_hf_generate(model, p) for p in shared]


def test_ngram_drafts_roll_back_inside_the_window(checkpoint):
    """Rejected drafts are trimmed from every group; the sliding group kept ``num_speculative_tokens`` more
    tokens behind its window, so the next query still sees its whole window."""
    arch, path, model = checkpoint
    gen = torch.Generator().manual_seed(4)
    prompts = [(torch.randint(0, model.config.vocab_size, (6,), generator=gen).tolist() * 6)[:n] for n in (20, 33)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.get_stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert [o.outputs[0].token_ids for o in outputs] == [_hf_generate(model, p) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_groups_keep_greedy_tokens(checkpoint):
    """On CUDA: the Triton kernels read each group's block table (several groups run eagerly)."""
    arch, path, model = checkpoint
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=BLOCK, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [_hf_generate(model, p) for p in prompts]
