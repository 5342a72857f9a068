"""kv_cache_dtype (vLLM's --kv-cache-dtype): an FP8 KV cache end to end on the tiny Llama, its checkpoint scales,
and the errors for values dsinfer cannot honour (DeepSeek's FP8 latent cache: tests/models/test_deepseek.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from dsinfer import LLM, SamplingParams
from dsinfer.engine.arg_utils import EngineArgs

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 200, 11], [7, 7, 130, 250, 1, 64]]


def _first_token_logprobs(llm: LLM) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


@pytest.mark.parametrize("name,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                        ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_cache_serves_with_one_byte_per_element(tiny_llama_dir, name, dtype):
    auto = LLM(str(tiny_llama_dir), kv_cache_memory_gb=0.01)
    fp8 = LLM(str(tiny_llama_dir), kv_cache_memory_gb=0.01, kv_cache_dtype=name)
    runner = fp8.engine.runner
    assert all(layer.kv_cache.dtype == dtype for layer in runner.model.attention_layers())
    # the model's dtype: float32 on CPU (4x the FP8 bytes), bfloat16 on a GPU (2x)
    ratio = auto.engine.runner.model.attention_layers()[0].kv_cache.dtype.itemsize
    assert runner.kv_bytes_per_token * ratio == auto.engine.runner.kv_bytes_per_token
    assert runner.num_blocks // ratio == auto.engine.runner.num_blocks  # the same byte budget
    # the same answers up to FP8 rounding of K and V: top token and its log-probability
    for want, got in zip(_first_token_logprobs(auto), _first_token_logprobs(fp8)):
        top = max(want, key=want.get)
        assert top == max(got, key=got.get)
        assert abs(want[top] - got[top]) < (0.05 if name != "fp8_e5m2" else 0.15)
    # generation with preemption-free decode over the FP8 cache runs to its length
    out = fp8.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]


def test_deterministic_mode_over_an_fp8_cache_is_batch_invariant(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="fp8", deterministic=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([{"prompt_token_ids": p} for p in [PROMPTS[1], PROMPTS[0], PROMPTS[1]]], params,
                           use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone


def test_checkpoint_kv_scales_are_loaded_and_used(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, ckpt)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.kv_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0)}, str(ckpt / "kv_scales.safetensors"))
    llm = LLM(str(ckpt), kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 2.0), (0.25, 4.0)]
    # stored k / k_scale: the cache holds twice the keys' values in layer 0
    plain = LLM(str(tiny_llama_dir), kv_cache_dtype="fp8")
    for want, got in zip(_first_token_logprobs(plain), _first_token_logprobs(llm)):
        top = max(want, key=want.get)
        assert top == max(got, key=got.get) and abs(want[top] - got[top]) < 0.1


def test_bad_checkpoint_kv_scale_names_the_tensor(tiny_llama_dir, tmp_path):
    ckpt = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, ckpt)
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(-1.0)}, str(ckpt / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale.*positive"):
        LLM(str(ckpt), kv_cache_dtype="fp8")


def test_unknown_kv_cache_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model=str(tiny_llama_dir), kv_cache_dtype="int8").create_engine_config()
