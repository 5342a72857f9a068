"""``dsinfer bench``: serving benchmarks against any OpenAI-compatible URL, sweeps over request rates or
concurrencies, and Pareto plots of throughput per GPU against throughput per user.

Modules: ``datasets`` (the prompts: random, shared-prefix, JSONL), ``serve`` (the streaming client and one run's
result), ``metrics`` (percentiles and goodput from the raw per-request figures), ``sweep`` (a grid of runs),
``pareto`` (the frontier and the PNG), ``cli`` (the argparse front end). Nothing here imports the engine: a bench
process only speaks HTTP."""
