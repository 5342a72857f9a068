"""``dsinfer bench``: serving benchmarks against any OpenAI-compatible URL, sweeps over request rates or
concurrencies, Pareto plots of throughput per GPU against throughput per user, and offline throughput / latency.

Modules: ``datasets`` (the prompts: random, shared-prefix, JSONL), ``serve`` (the streaming client and one run's
result), ``metrics`` (percentiles and goodput from the raw per-request figures), ``sweep`` (a grid of runs),
``pareto`` (the frontier and the PNG), ``offline`` (``throughput`` and ``latency`` through ``LLM``), ``cli`` (the
argparse front end). Only ``offline`` imports the engine; serve and sweep only speak HTTP."""
