"""Decode step time at small batches with one ``DSINFER_*`` variable swept, in one process (CUDA only).

The model loads once; for each value the decode CUDA graphs of the batch sizes asked for are captured again, then
timed as ``latency.py`` times them: the graph replay (median of 40) and the pipelined step (best of three 30-step
runs), beside the floor. The engine reads the variables once, at start-up, into its ``KernelConfig``; so for each
value the sweep applies it as start-up would: the process-wide kernel options through ``ops.options.configure``,
the ones the model hands its layers when it is built (``LAYER_OPTIONS``) on the built layers. The logits of
one fixed token per row are compared with the first value's: 0 when the variable changes no value, a few units
in the last place of bf16 when it changes a summation order. Values repeat to show the noise (``0 1 0 1``).
``--var module.path:NAME`` sets a module constant instead (values read as Python literals), for switches that
have no variable, e.g. ``--var dsinfer.layers.mla:FUSED_ABSORB_MAX_HEAD_ROWS --values 0 64 0 64``.

    python3 benchmarks/decode_env_sweep.py --var DSINFER_ROUTER_GEMV --values 0 1 0 1 \\
        --model benchmarks/configs/deepseek-v2-lite --batch-sizes 1 16 64
    python3 benchmarks/decode_env_sweep.py --var DSINFER_FUSED_SILU_MUL --values 0 1 0 1  # the gated GEMV tile
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.latency import (  # noqa: E402
    DEFAULT_MODEL,
    Sequences,
    decode_floor_ms,
    make_llm,
    pipelined_ms,
    timed_ms,
    weight_shape,
)
from benchmarks.roofline import measure_bandwidth  # noqa: E402
from dsinfer import envs  # noqa: E402
from dsinfer.config import KernelConfig  # noqa: E402
from dsinfer.ops import options  # noqa: E402


def _set_on(model, attr: str, value) -> None:
    for module in model.modules():
        if hasattr(module, attr) and module is not model:
            setattr(module, attr, value)


def _side_stream(model, on: bool) -> None:
    from dsinfer.layers.streams import SideStream

    _set_on(model, "side_stream", SideStream() if on else None)


def _router_gemv(model, on: bool) -> None:
    from dataclasses import replace

    from dsinfer.layers.moe import Router

    for module in model.modules():
        if isinstance(module, Router):
            module.cfg = replace(module.cfg, gemv=on)


# variables the model hands its layers when it is built (KernelConfig fields), and how to set them on built layers
LAYER_OPTIONS = {
    "DSINFER_FUSED_SILU_MUL": lambda model, on: _set_on(model, "fused_silu_mul", on),
    "DSINFER_ROUTER_GEMV": _router_gemv,
    "DSINFER_SIDE_STREAM": _side_stream,
}
# read at start-up like the others, but they change how the weights are laid out: one run per value
NEEDS_A_NEW_MODEL = ("DSINFER_FUSE_SHARED_EXPERTS",)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--var", required=True, help="a declared DSINFER_* variable (`dsinfer env` lists them), or "
                   "module.path:NAME (a module constant)")
    p.add_argument("--values", nargs="+", required=True)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="directory holding a config.json")
    p.add_argument("--hf-overrides", type=json.loads, default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", None
    if ":" in args.var:
        module, name = args.var.split(":")
        if not hasattr(importlib.import_module(module), name):
            p.error(f"--var {args.var!r}: {module} has no {name}")
        args.values = [ast.literal_eval(v) for v in args.values]
        return args
    declared = {var.name: var for var in envs.all_vars()}
    if args.var not in declared:
        p.error(f"--var {args.var!r} is not a declared DSINFER_* variable")
    if args.var in NEEDS_A_NEW_MODEL:
        p.error(f"--var {args.var}: it changes the weights' layout when the model is built; time each value in "
                "a run of its own (latency.py)")
    for value in args.values:  # each value must parse before the model loads
        os.environ[args.var] = value
        declared[args.var].get()
    return args


def set_value(var: str, value, model=None) -> None:
    """A DSINFER_* variable, or a module constant (``module.path:NAME``). A variable is applied as the engine's
    start-up applies it: the process-wide kernel options again from the environment, and, given the built
    ``model``, the layer options on its layers."""
    if ":" in var:
        module, name = var.split(":")
        setattr(importlib.import_module(module), name, value)
        return
    os.environ[var] = value
    options.configure(KernelConfig.from_envs())
    if model is not None and var in LAYER_OPTIONS:
        declared = {v.name: v for v in envs.all_vars()}
        LAYER_OPTIONS[var](model, declared[var].get())


def summary_rows(rows: list[tuple[str, int, float, float]]) -> list[str]:
    """The sweep's (value, batch, graph ms, step ms) rows as a table of means per value and batch, in first-seen
    order, with each mean's ratio to the first value's at that batch: single rows move by a few percent between
    replays of one process, the mean of the repeats (``0 1 0 1``) less."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for value, batch, graph_ms, step_ms in rows:
        groups.setdefault((value, batch), []).append((graph_ms, step_ms))
    means = {key: (statistics.fmean(g for g, _ in runs), statistics.fmean(s for _, s in runs), len(runs))
             for key, runs in groups.items()}
    first = {}
    for (_, batch), mean in means.items():
        first.setdefault(batch, mean)
    lines = ["| value | batch | runs | mean graph ms | mean step ms | graph vs the first value | "
             "step vs the first value |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (value, batch), (graph_ms, step_ms, runs) in means.items():
        base_graph, base_step, _ = first[batch]
        lines.append(f"| {value} | {batch} | {runs} | {graph_ms:.3f} | {step_ms:.3f} | "
                     f"{graph_ms / base_graph - 1:+.1%} | {step_ms / base_step - 1:+.1%} |")
    return lines


def main(argv=None) -> None:
    from dsinfer.runner.cuda_graphs import DecodeGraphs
    from dsinfer.scheduler.scheduler import ScheduledRequest, standalone_output

    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_env_sweep.py needs a CUDA device")
    set_value(args.var, args.values[0])
    llm = make_llm(args.model, args, max_num_seqs=max(args.batch_sizes))
    runner = llm.engine.runner
    bandwidth = measure_bandwidth()
    shape = weight_shape(runner.model)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; {args.var} over {args.values}")
    steps = {}
    for batch in args.batch_sizes:
        seqs = Sequences(llm, [args.context] * batch, f"b{batch}-")
        seqs.randomize_kv(runner)
        items = [ScheduledRequest(r, 1, args.context - 1) for r in seqs.requests]
        runner.execute(standalone_output(items).plan)
        steps[batch] = standalone_output(items, resend=False).plan
    first = runner.graphs
    reference: dict[int, torch.Tensor] = {}
    rows: list[tuple[str, int, float, float]] = []
    print("| value | batch | graph ms | step ms | floor ms | graph / floor | max logit diff vs the first value |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for value in args.values:
        set_value(args.var, value, runner.model)
        graphs = DecodeGraphs(runner.model, max(args.batch_sizes), first.block_tables.shape[1], first.max_seq_len,
                              runner.device, sizes=tuple(sorted(args.batch_sizes)))
        graphs.capture(torch.cuda.graph_pool_handle(), torch.cuda.Stream(runner.device))
        runner.graphs = graphs
        for batch, sched in steps.items():
            for _ in range(3):
                runner.execute(sched)
            size = graphs.padded_size(batch)
            replay = functools.partial(graphs.replay, size)
            graph_ms = statistics.median(timed_ms(replay, runner.device) for _ in range(40))
            step_ms = min(pipelined_ms(runner, sched, 30) for _ in range(3))
            graphs.input_ids[:batch].fill_(7)  # one fixed token: the logits depend on nothing else that changed
            logits = graphs.replay(size)[:batch].float().clone()
            diff = (logits - reference.setdefault(batch, logits)).abs().max().item()
            floor = decode_floor_ms(shape, batch, args.context, runner.kv_bytes_per_token, bandwidth)
            print(f"| {value} | {batch} | {graph_ms:.3f} | {step_ms:.3f} | {floor:.3f} | {graph_ms / floor:.3f} | "
                  f"{diff:.3g} |", flush=True)
            rows.append((str(value), batch, graph_ms, step_ms))  # str: a constant's value may be a dict
    print()
    print("\n".join(summary_rows(rows)))


if __name__ == "__main__":
    main()
