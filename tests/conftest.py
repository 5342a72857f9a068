"""Session-wide fixtures for every test directory: a tiny random Llama checkpoint and the bundled model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels are tested on CPU through Triton's interpreter. The flag must be set before any module that holds
# @triton.jit functions is imported (tests in other directories may import them first), and it only matters where
# DSINFER_USE_TRITON=always routes an op to Triton, which only the op tests do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama (vocab 256, eos 2, no tokenizer) from transformers; prompts are ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_llm():
    """The bundled SmolLM2-135M-Instruct in float32, loaded once per session; for tests where text matters."""
    from dsinfer import LLM

    return LLM(dtype="float32")
