"""``dsinfer eval``: the engine's accuracy checked against references.

Modules: ``scoring`` (log-likelihoods from the engine's prompt logprobs), ``parity`` (our logprobs against
transformers'), ``ppl`` (sliding-window perplexity of a text file), ``tasks`` (multiple-choice and generation tasks
from local JSONL, generation saved first, scoring a separate step), ``cli`` (the argparse front end). ``data/``
holds the small evaluation set that ships with the repo."""
