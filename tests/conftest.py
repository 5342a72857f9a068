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

# Under pytest-xdist (`make test` runs a worker per core, at most 4) each worker keeps to one intra-op thread: two
# workers of two threads each on two cores would only take turns.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    # The servers and worker processes the tests start share the cores with the other workers: OpenMP threads
    # that spin while waiting (what `import dsinfer` asks for, DSINFER_CPU_SPIN_COUNT) then wait on a descheduled
    # thread for a whole time slice at every parallel region. Two live servers at once ran a request ~4x slower
    # spinning than sleeping (24.9 s against 5.9 s; the suite took 36 minutes, now 22).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _row_independent_interpreter_dot() -> None:
    """Give the interpreter a tl.dot whose every output element sums over K in one fixed order.

    The interpreter's dot is numpy's matmul, whose BLAS (OpenBLAS 0.3.31's Haswell SGEMM, for one) rounds a row
    differently by its position in the tile, so on CPU a kernel's result would depend on its companion rows where
    the GPU's MMA does not. The batch-invariance tests check the kernels' own reduction order, which this keeps
    visible. numpy's einsum runs its own loops, in one order for every row."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot"):
        return

    def create_dot(self, a, b, d, *precision):  # (input_precision, max_num_imprecise_acc): no effect on CPU
        a_data, b_data = a.data, b.data
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):  # fp8: via fp16, as Triton
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        acc = d.data.dtype
        product = np.einsum("...mk,...kn->...mn", a_data.astype(acc), b_data.astype(acc))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


_row_independent_interpreter_dot()

@pytest.fixture(autouse=True)
def _kernel_options_restored():
    """The process-wide kernel options (``ops.options``) as they were before each test: a test that sets them, or
    builds an engine (whose loader sets them from its config), leaves them to no other test."""
    from dsinfer.ops import options

    before = options.current()
    yield
    options.configure(before)


@pytest.fixture
def kernel_options():
    """``set(**changes)``: change the process-wide kernel options for this test (``use_triton="always"``, ``pdl``,
    ``pdl_early_trigger``, ``triton_gemv``), as an engine's start-up would from its ``KernelConfig``."""
    from dsinfer.ops import options

    return lambda **changes: options.configure(options.configured(**changes))


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
def tiny_deepseek_dir(tmp_path_factory) -> Path:
    """A random 2-layer DeepSeek-V2 (MLA, softmax MoE with shared experts, YaRN) from transformers; prompts are
    ids (the V2 checkpoint of tests/models/test_deepseek.py)."""
    from tests.models.test_deepseek import save_v2

    path = tmp_path_factory.mktemp("tiny_deepseek_v2")
    save_v2(path)
    return path


@pytest.fixture(scope="session")
def smollm2_llm():
    """The bundled SmolLM2-135M-Instruct in float32, loaded once per session; for tests where text matters."""
    from dsinfer import LLM

    return LLM(dtype="float32")
