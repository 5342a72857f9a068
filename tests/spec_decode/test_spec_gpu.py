"""Speculative decoding on CUDA (gpu-marked): verification is lossless through the Triton kernels and the decode
graphs of 1 + k tokens a sequence. An oracle drafter (``benchmarks/spec_decode_oracle.py``) proposes the
speculation-off run's own tokens, all right (rate 1) or half corrupted: in float32 the outputs must be the
speculation-off run's and, at rate 1, nearly every draft kept; in deterministic mode (batch-invariant kernels) the
same holds in bfloat16, whatever the step's shape."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.spec_decode_oracle import METHOD, OracleBook, decode_run, install, spec_delta, spec_snapshot
from dsinfer import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

K = 3
OUTPUT_LEN = 40
# Llama-3.1-8B's head size and GQA ratio (128, 4 query heads per KV head) at two layers
WIDE_LLAMA = dict(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wide_llama")
    LlamaForCausalLM(LlamaConfig(**WIDE_LLAMA)).save_pretrained(path)
    return path


def _prompts(count, vocab):
    rng = random.Random(count)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def _check(path, *, dtype, enforce_eager, deterministic=False, batch=(1, 6)):
    kwargs = dict(device="cuda", dtype=dtype, max_model_len=256, kv_cache_memory_gb=1, enforce_eager=enforce_eager,
                  max_num_seqs=8, deterministic=deterministic)
    off = LLM(str(path), **kwargs)
    book = OracleBook(vocab_size=off.engine.model_config.vocab_size)
    install(book)
    on = LLM(str(path), speculative_config={"method": METHOD, "num_speculative_tokens": K}, **kwargs)
    for b in batch:
        prompts = _prompts(b, book.vocab_size)
        references, _ = decode_run(off, prompts, OUTPUT_LEN)
        for prompt, ref in zip(prompts, references):
            book.references[tuple(prompt)] = ref
        for rate in (1.0, 0.5):
            for prompt in prompts:
                book.rates[tuple(prompt)] = rate
            before = spec_snapshot(on)
            outputs, _ = decode_run(on, prompts, OUTPUT_LEN)
            stats = spec_delta(spec_snapshot(on), before)
            assert outputs == references, (b, rate, stats)
            if rate == 1.0:  # every draft is the reference's: all kept (the last step may verify fewer)
                assert stats["acceptance_length"] > 1 + 0.9 * K, (b, stats)
    del off, on


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_float32_verification_is_lossless(tiny_llama_dir, enforce_eager):
    _check(tiny_llama_dir, dtype="float32", enforce_eager=enforce_eager)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_float32_verification_is_lossless_at_llama_8b_head_shapes(wide_llama_dir, enforce_eager):
    _check(wide_llama_dir, dtype="float32", enforce_eager=enforce_eager)


def test_deterministic_bfloat16_verification_is_lossless(wide_llama_dir):
    _check(wide_llama_dir, dtype="bfloat16", enforce_eager=False, deterministic=True)


def test_deepseek_float32_verification_is_lossless(tiny_deepseek_dir):
    _check(tiny_deepseek_dir, dtype="float32", enforce_eager=False)
