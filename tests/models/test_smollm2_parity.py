"""The bundled SmolLM2-135M GGUF: dsinfer against transformers loading the same file (``gguf_file=``)."""

from __future__ import annotations

import pytest
import torch

from dsinfer import SamplingParams
from dsinfer.models.loader.gguf import default_model_path

from .hf_reference import hf_greedy, hf_prompt_logprobs

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans",
    "A haiku about autumn leaves:",
]


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def test_smollm2_matches_transformers(smollm2_llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outputs = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    worst, identical = 0.0, 0
    for out in outputs:
        ids = out.prompt_token_ids
        ref = hf_prompt_logprobs(hf_model, ids)
        ours = torch.tensor([pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])])
        worst = max(worst, (ours - ref).abs().max().item())
        identical += out.outputs[0].token_ids == hf_greedy(hf_model, ids, NEW_TOKENS)
    print(f"SmolLM2: max |prompt logprob difference| = {worst:.2e}, identical greedy: {identical}/{len(PROMPTS)}")
    assert worst < 1e-3
    assert identical == len(PROMPTS)
