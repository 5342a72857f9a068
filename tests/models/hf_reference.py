"""HF transformers as the reference: prompt logprobs and greedy continuations without any logits processor.

``generate(min_new_tokens=...)`` would ban EOS, which dsinfer's ``ignore_eos`` does not; a plain argmax loop over
HF's own KV cache is the faithful reference.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


@torch.no_grad()
def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    out = model(torch.tensor([ids]), use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(num_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens


def record_preemptions(llm) -> list:
    """The requests ``llm``'s scheduler preempts from now on, in order (a test asserts the list is not empty, so
    a cache that turned out large enough fails it rather than passing without a preemption)."""
    scheduler, preempted = llm.engine.scheduler, []
    original = scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append(request), original(request))
    return preempted
