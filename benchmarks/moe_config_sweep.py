"""One entry of the GEMM tile table (``ops/triton/configs/moe.json``) swept inside the decode CUDA graph.

The tuners time a kernel alone (``tune_deepseek.py``, ``tune_gemv.py``); in a decode step the same kernel runs
between others under programmatic dependent launch, and the tile that wins alone need not win there (session 22:
V2-Lite's one-token MoE down GEMM with 5 pipeline stages instead of 4 took the batch-1 step from 2.133 to 2.045
ms, a tile the solo timing had ranked level). This runs ``decode_env_sweep.py``'s loop with each value a dict
literal of overrides for the entry ``--key`` / ``--bucket``: ``gate_up`` keys replace the entry's own, ``down``
keys its ``down`` overrides; ``{}`` is the table as it is.

    python3 benchmarks/moe_config_sweep.py --key 66,1408,2048,bfloat16 --bucket 0.12 \\
        --values "{}" "{'down': {'num_stages': 5}}" "{}" "{'down': {'num_stages': 5}}" \\
        --batch-sizes 1 --model benchmarks/configs/deepseek-v2-lite
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.decode_env_sweep as sweep  # noqa: E402
from dsinfer.ops.triton import moe  # noqa: E402


def overridden(entry: dict, value: dict) -> dict:
    """The entry with a sweep value's ``gate_up`` and ``down`` overrides applied."""
    unknown = set(value) - {"gate_up", "down"}
    if unknown:
        raise ValueError(f"a sweep value takes the keys 'gate_up' and 'down', got {sorted(unknown)}")
    cfg = {**entry, **value.get("gate_up", {})}
    if "down" in entry or "down" in value:
        cfg["down"] = {**entry.get("down", {}), **value.get("down", {})}
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--key", required=True, help='a key of moe.json, e.g. "66,1408,2048,bfloat16"')
    p.add_argument("--bucket", required=True, help='one of its buckets, e.g. "0.12"')
    p.add_argument("--values", nargs="+", required=True, help="dict literals (see the module doc)")
    args, rest = p.parse_known_args(argv)
    table = moe._config_table()
    if args.bucket not in table.get(args.key, {}):
        p.error(f"moe.json has no bucket {args.bucket!r} under {args.key!r}")
    entry = dict(table[args.key][args.bucket])
    for value in args.values:
        overridden(entry, ast.literal_eval(value))  # every value must parse before the model loads

    def set_value(var: str, value: dict) -> None:
        table[args.key][args.bucket] = overridden(entry, value)  # read when a graph is captured

    sweep.set_value = set_value
    sweep.main(["--var", "dsinfer.ops.triton.moe:_CONFIGS", "--values", *args.values, *rest])


if __name__ == "__main__":
    main()
