"""``dsinfer eval``: the engine's accuracy checked against references.

Modules: ``scoring`` (log-likelihoods from the engine's prompt logprobs), ``reference`` (the transformers model
compared against), ``parity`` (our logprobs against transformers'), ``ppl`` (sliding-window perplexity of a text
file), ``tasks`` (multiple-choice and generation tasks from local JSONL, generation saved first, scoring a separate
step), ``harness`` (lm-eval task YAMLs through the engine; imports lm-eval), ``cli`` (the argparse front end).
``data/`` holds the small evaluation set that ships with the repo."""
