"""`make demo`: a few chat prompts through the offline engine with the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import time

from dsinfer import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning a new programming language.",
    "Explain in one sentence what a GPU is.",
]


def main() -> None:
    llm = LLM()
    print(f"model loaded in {llm.load_seconds:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=96)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    num_tokens = 0
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"\n### {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}]")
    print(f"\n{len(PROMPTS)} prompts, {num_tokens} output tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} output tok/s")


if __name__ == "__main__":
    main()
