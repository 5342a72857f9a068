"""``LLM(quantization=...)`` on CPU: tiny checkpoints quantized at load, and the bundled GGUF's own blocks."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.layers.norm import RMSNorm
from dsinfer.ops import cpu_quant

PROMPTS = [{"prompt_token_ids": [1, 17, 42, 99, 5, 63, 7]}, {"prompt_token_ids": [3, 200, 11, 250]}]


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    values = []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        ids = out.prompt_token_ids
        values += [pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    return torch.tensor(values)


@pytest.fixture(scope="module")
def dense_logprobs(tiny_llama_dir):
    return _prompt_logprobs(LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))


@pytest.mark.parametrize("fmt,tolerance", [("int8", 0.02), ("int4", 0.3)])
def test_quantized_tiny_llama_stays_close_to_float32(tiny_llama_dir, dense_logprobs, fmt, tolerance):
    llm = LLM(str(tiny_llama_dir), quantization=fmt, num_kv_blocks=64)
    got = _prompt_logprobs(llm)
    assert (got - dense_logprobs).abs().max().item() < tolerance
    assert not torch.equal(got, dense_logprobs)  # the weights really are quantized


def test_dummy_weights_quantize_too(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), load_format="dummy", quantization="int4", num_kv_blocks=64)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    norms = [m for m in llm.engine.runner.model.modules() if isinstance(m, RMSNorm)]
    # with the C++ kernels built the norms take the fused one (the float32 path keeps torch's: exact parity)
    assert norms and all(m.native_cpu == cpu_quant.native_available() for m in norms)


def test_bad_quantization_values_are_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama_dir), quantization="int3")
    with pytest.raises(ValueError, match="needs a GGUF model file"):
        LLM(str(tiny_llama_dir), quantization="gguf")


@pytest.mark.skipif(not cpu_quant.native_available(), reason="the C++ kernel did not build here")
def test_bundled_gguf_runs_its_own_blocks_by_default_and_answers():
    llm = LLM(num_kv_blocks=64)
    config = llm.engine.model_config
    assert config.quantization == "gguf" and config.quantized_weights is not None
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
