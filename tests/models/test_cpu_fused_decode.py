"""A quantized Llama-family model's CPU decode steps with each layer as one C++ call
(``models/cpu_fused_decode.py``, ``ops/csrc/cpu_layer.cpp``): bit for bit the module path, on the steps and
models it covers, and the module path everywhere else."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.models import cpu_fused_decode
from dsinfer.ops import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.native_available(), reason="the CPU kernels did not build")

# prompts of different lengths: sequences end at different offsets in their blocks (16 slots), one crosses a
# block boundary while decoding
PROMPTS = [list(range(100, 140)), list(range(30, 47)), list(range(50, 55))]


def _outputs(llm: LLM, fused: bool, prompts=PROMPTS, max_tokens: int = 14):
    llm.engine.runner.model.cpu_fused_layer = fused
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture
def layer_calls(monkeypatch):
    calls = []
    real = cpu_fused_decode.decode_layer

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])  # the step's sequences
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_fused_decode, "decode_layer", counting)
    return calls


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_tiny_llama_decodes_bit_for_bit_as_the_modules(tiny_llama_dir, fmt, layer_calls):
    # no prefix caching: the second run would read the first one's prompt KV instead of computing it
    llm = LLM(str(tiny_llama_dir), quantization=fmt, num_kv_blocks=64, enable_prefix_caching=False)
    fused = _outputs(llm, True)
    assert layer_calls and set(layer_calls) <= {1, 2, 3}  # decode steps went through the C++ layer
    del layer_calls[:]
    assert _outputs(llm, False) == fused
    assert not layer_calls


def test_the_bundled_gguf_decodes_bit_for_bit_as_the_modules(layer_calls):
    llm = LLM(num_kv_blocks=64, enable_prefix_caching=False)  # Q4_1 blocks as int4, the Q8_0 head as int8
    fused = _outputs(llm, True, max_tokens=8)
    assert isinstance(llm.engine.runner.model._fused_decode, cpu_fused_decode.FusedDecode)  # built at first use
    assert len(layer_calls) == 7 * 30  # 7 decode steps (the first token is the prompt step's), 30 layers each
    assert _outputs(llm, False, max_tokens=8) == fused


def test_steps_and_models_it_does_not_cover_run_the_modules(tiny_llama_dir, layer_calls, monkeypatch):
    dense = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)  # not quantized: not covered
    dense.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert dense.engine.runner.model._fused_decode is None and not layer_calls
    # a quantized model: a step with a prompt row (chunked prefill beside decodes) runs the modules, whole
    llm = LLM(str(tiny_llama_dir), quantization="int4", num_kv_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    steps = []
    real = cpu_fused_decode.FusedDecode.forward

    def recording(self, model, input_ids, positions, batch):
        out = real(self, model, input_ids, positions, batch)
        steps.append((batch.max_query_len, out is not None))
        return out

    monkeypatch.setattr(cpu_fused_decode.FusedDecode, "forward", recording)
    mixed = _outputs(llm, True, prompts=[list(range(10, 50)), [7, 8, 9]])
    assert (1, True) in steps and any(q > 1 and not taken for q, taken in steps)
    assert _outputs(llm, False, prompts=[list(range(10, 50)), [7, 8, 9]]) == mixed
