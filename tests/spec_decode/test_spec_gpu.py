"""Speculative decoding on CUDA (gpu-marked): verification is lossless through the Triton kernels and the decode
graphs of 1 + k tokens a sequence. An oracle drafter (``benchmarks/spec_decode_oracle.py``) proposes the
speculation-off run's own tokens, all right (rate 1) or half corrupted: in float32 the outputs must be the
speculation-off run's and, at rate 1, nearly every draft kept; in deterministic mode (batch-invariant kernels) the
same holds in bfloat16, whatever the step's shape."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from benchmarks.spec_decode_oracle import (
    METHOD,
    OracleBook,
    OracleDrafter,
    decode_run,
    install,
    spec_delta,
    spec_snapshot,
)
from dsinfer import LLM
from dsinfer.core.step_latency import DecodePadding
from dsinfer.spec_decode import register_drafter

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
            book.learn(prompt, ref)
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


class RaggedOracle(OracleDrafter):
    """The oracle's drafts cut to 0..k by (request, output count): the requests of a step verify different
    counts, as confidence scheduling makes them."""

    def __init__(self, book: OracleBook, k: int):
        super().__init__(book, k)
        self.k = k

    def propose(self, request, num_tokens: int):
        cut = zlib.crc32(f"{request.request_id}:{request.num_output_tokens}".encode()) % (self.k + 1)
        return super().propose(request, min(num_tokens, cut))


@pytest.mark.parametrize("dtype,deterministic", [("float32", False), ("bfloat16", True)],
                         ids=["float32", "deterministic-bfloat16"])
def test_mixed_draft_counts_replay_padded_decode_graphs_losslessly(wide_llama_dir, dtype, deterministic):
    """Steps whose requests verify different draft counts are padded to the longest and replay that length's
    decode graph (graphs of every length 1..1 + k), never eager, with the speculation-off run's tokens."""
    kwargs = dict(device="cuda", dtype=dtype, max_model_len=256, kv_cache_memory_gb=1, max_num_seqs=8,
                  deterministic=deterministic)
    off = LLM(str(wide_llama_dir), **kwargs)
    book = OracleBook(vocab_size=off.engine.model_config.vocab_size)

    register_drafter("ragged-oracle", lambda config: RaggedOracle(book, config.speculative.num_speculative_tokens))
    on = LLM(str(wide_llama_dir), speculative_config={"method": "ragged-oracle", "num_speculative_tokens": K},
             **kwargs)
    runner = on.engine.runner
    assert {q for _, q in runner.graphs.graphs} == set(range(1, K + 2))
    assert on.engine.executor.decode_padding == DecodePadding(runner.graphs.max_size, K + 1)
    steps = []  # per step: (its query lengths, the graph length it replayed or None: eager)
    forward, replay = runner._forward_with_hidden, runner._replay

    def replaying(inputs, size, q, padded):
        steps[-1][1] = q
        return replay(inputs, size, q, padded)

    def recording(inputs):
        steps.append([np.diff(inputs.host.query_start_loc).tolist(), None])
        return forward(inputs)

    runner._forward_with_hidden, runner._replay = recording, replaying
    prompts = _prompts(6, book.vocab_size)
    references, _ = decode_run(off, prompts, OUTPUT_LEN)
    for prompt, ref in zip(prompts, references):
        book.learn(prompt, ref)
        book.rates[tuple(prompt)] = 1.0
    before = spec_snapshot(on)
    outputs, _ = decode_run(on, prompts, OUTPUT_LEN)
    stats = spec_delta(spec_snapshot(on), before)
    assert outputs == references, stats
    mixed = [(lens, q) for lens, q in steps if len(set(lens)) > 1 and max(lens) <= K + 1]
    assert len(mixed) >= 5, steps
    assert all(q == max(lens) for lens, q in mixed), mixed  # each replayed its longest length's graph
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0, stats
    del off, on
