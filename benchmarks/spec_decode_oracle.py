"""Speculative decoding with a draft oracle: speed against acceptance, and confidence scheduling on against off.

    python benchmarks/spec_decode_oracle.py                        # CPU, the bundled SmolLM2, tiny batches
    python benchmarks/spec_decode_oracle.py --device cuda --dtype bfloat16 --load-format dummy \
        --model benchmarks/configs/llama-3.1-8b --part speedup --batch-sizes 1 64
    python benchmarks/spec_decode_oracle.py --device cuda --dtype bfloat16 --load-format dummy \
        --model benchmarks/configs/llama-3.1-8b --part confidence --batch-sizes 16 64 128

Random weights (and a small model's own drafts) give no real acceptance, so the drafter here is an oracle (a
benchmark's, plugged in with ``spec_decode.register_drafter``): it proposes the tokens the speculation-off run of
the same prompts produced, each draft token corrupted (replaced by another id) with probability 1 - rate, the
request's per-token acceptance rate, seeded by (request, position) so that a draft proposed again is the same.
Its confidence is calibrated online per request and position, as the n-gram drafter's. Greedy decoding, EOS
ignored, random prompts of ``--input-len`` tokens, ``--output-len`` tokens each.

Parts: ``speedup``: decode tokens/s speculation off against on at ``--rate`` (k = ``--k``) per batch size;
``confidence``: mixed acceptance (half the requests at ``--high``, half at ``--low``), speculation off, on, and
on with confidence scheduling: decode tokens/s and drafts verified per request-step. Decode tokens/s: output
tokens after each request's first / (the last token's time - the time every request had its first token), the
median of ``--repeats`` alternating runs. Each engine runs the workload once untimed first (compiles, and feeds
the step-latency curve real steps); the speculation-off engine's full run gives the references, and the oracle
learns every continuation each run produced (keyed by the tokens before it), so where bf16 batches round a
near-tie differently from the reference run, the branch taken is known from an earlier run
(``--learning-runs``). The measured acceptance length (1 + accepted / verifying request-steps) is printed
beside the speeds, and the speedup part's title gives the rate's expected one (1 + r + ... + r^k); "identical"
compares with the speculation-off run, which only deterministic mode (or float32) promises.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer import LLM, SamplingParams  # noqa: E402
from dsinfer.spec_decode import register_drafter  # noqa: E402
from dsinfer.spec_decode.base import Draft  # noqa: E402
from dsinfer.spec_decode.calibration import Calibrator  # noqa: E402

METHOD = "oracle"


CONTEXT = 4  # the tokens before a position that key its continuation (a run that left another's path differs)


@dataclass
class OracleBook:
    """What the oracle knows: every continuation an earlier run of a prompt produced, keyed by (prompt, position,
    the CONTEXT tokens before it), and each prompt's per-token acceptance rate.

    Keying by the context, not by the position alone, keeps the oracle right after a run leaves the
    speculation-off run's path (a bfloat16 near-tie decided otherwise in another step shape): it knows that
    branch too once an earlier run has taken it, so a timed run's drafts are corrupted at the chosen rate only."""

    vocab_size: int
    seed: int = 0
    continuations: dict[tuple, int] = field(default_factory=dict)
    references: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # the speculation-off outputs
    rates: dict[tuple[int, ...], float] = field(default_factory=dict)

    def learn(self, prompt: list[int], output: list[int]) -> None:
        key, tokens, n = tuple(prompt), list(prompt) + list(output), len(prompt)
        for position, token in enumerate(output):
            self.continuations[(key, position, tuple(tokens[max(n + position - CONTEXT, 0):n + position]))] = token

    def draft(self, key: tuple[int, ...], position: int, context: tuple[int, ...], count: int) -> list[int]:
        """Up to ``count`` draft ids from ``position`` on after ``context``: the known continuation, each id
        replaced by another with probability 1 - rate (seeded by prompt and position)."""
        ids = []
        for p in range(position, position + count):
            token = self.continuations.get((key, p, context))
            if token is None:
                break
            context = (*context, token)[-CONTEXT:]
            digest = hashlib.blake2b(repr((self.seed, key, p)).encode(), digest_size=8).digest()
            u = int.from_bytes(digest, "little") / 2 ** 64
            if u >= self.rates.get(key, 0.0):
                token = (token + 1 + int(u * 1e6) % (self.vocab_size - 1)) % self.vocab_size  # any id but it
            ids.append(token)
        return ids


class OracleDrafter:
    """Proposes a request's reference continuation, corrupted to its acceptance rate; calibrated confidence."""

    proposes_ahead = True

    def __init__(self, book: OracleBook, k: int):
        self.book = book
        self.calibrator = Calibrator(k)
        self._counts: dict[str, object] = {}

    def propose(self, request, num_tokens: int) -> Draft:
        context = tuple(request.all_token_ids[-CONTEXT:])
        ids = self.book.draft(tuple(request.prompt_token_ids), request.num_output_tokens, context,
                              min(num_tokens, self.calibrator.num_positions + 1))
        counts = self._state(request)
        conf = self.calibrator.confidence(counts, min(len(ids), self.calibrator.num_positions))
        conf += [conf[-1] if conf else 0.5] * (len(ids) - len(conf))  # one ahead: past the calibrated positions
        return Draft(ids, conf)

    def observe(self, request, num_verified: int, num_kept: int) -> None:
        if num_verified:
            self.calibrator.observe(self._state(request), num_verified, num_kept)

    def _state(self, request):
        counts = self._counts.get(request.request_id)
        if counts is None:
            counts = self._counts[request.request_id] = self.calibrator.new_request()
        return counts


def install(book: OracleBook) -> None:
    """Register the oracle drafter (``speculative_config={"method": "oracle", ...}``) over ``book``."""
    register_drafter(METHOD, lambda config: OracleDrafter(book, config.speculative.num_speculative_tokens))


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def decode_run(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float]:
    """Run ``prompts`` together; -> their outputs and the decode tokens/s."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = f"{time.perf_counter_ns()}-"
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    all_first = last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        now = time.perf_counter()
        if all_first is None and len(outputs) == len(prompts) and all(outputs.values()):
            all_first, counted = now, sum(len(o) for o in outputs.values())
        last = now
    total = sum(len(o) for o in outputs.values())
    speed = (total - counted) / (last - all_first) if all_first is not None and last > all_first else float("nan")
    return [outputs[f"{tag}{i}"] for i in range(len(prompts))], speed


def profile_steps(llm: LLM, prompts: list[list[int]], steps: int) -> str:
    """A torch.profiler look at ``steps`` engine steps in the middle of decoding ``prompts``: wall and GPU time
    per step, the GPU's idle gaps (the host's share) and the kernels by time, then the host's functions over as
    many steps (cProfile); a table's text. On CPU (a smoke run) the device part is empty."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and llm.engine.config.device.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = llm.engine
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    tag = f"p{time.perf_counter_ns()}-"
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(20):  # past the prompts: decoding steadily
        engine.step()
    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    host = cProfile.Profile()  # the same number of steps again, for the host's functions
    host.enable()
    for _ in range(steps):
        engine.step()
    host.disable()
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / steps
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    long_gaps = sorted((g for g in gaps if g > 100), reverse=True)
    lines = [f"wall {wall_ms:.2f} ms/step, GPU busy {busy:.2f} ms/step ({busy / wall_ms:.0%}), "
             f"{len(kernels) / steps:.0f} kernels/step, gaps > 100 us: {len(long_gaps) / steps:.1f}/step, "
             f"{sum(long_gaps) / 1e3 / steps:.2f} ms/step (largest {', '.join(f'{g:.0f}' for g in long_gaps[:6])} us)"]
    lines += [f"  {ms:7.3f} ms/step  {name[:90]}" for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]]
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(14)
    lines += [line for line in text.getvalue().splitlines() if line.strip()][-16:]
    return "\n".join(lines)


def spec_snapshot(llm: LLM) -> dict:
    stats = llm.engine.get_stats()["spec_decode"]
    return dict(stats) if stats else {}


def spec_delta(after: dict, before: dict) -> dict:
    keys = ("num_drafts", "num_proposals", "num_draft_tokens", "num_accepted_tokens")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    d["verified_per_proposal"] = d["num_draft_tokens"] / d["num_proposals"] if d["num_proposals"] else 0.0
    d["acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return d


def timed(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    before = spec_snapshot(llm)
    outputs, speed = decode_run(llm, prompts, output_len)
    return {"tok_s": speed, "outputs": outputs, **spec_delta(spec_snapshot(llm), before)}


def engine(args: argparse.Namespace, spec: dict | None) -> LLM:
    return LLM(**engine_kwargs(args, spec))


def engine_kwargs(args: argparse.Namespace, spec: dict | None) -> dict:
    """The LLM arguments of one engine of the run."""
    kwargs = dict(dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_sizes),
                  speculative_config=spec, deterministic=args.deterministic)
    if args.model is not None:
        kwargs.update(model=args.model, load_format=args.load_format)
    if args.step_latency_dir is not None:
        kwargs["step_latency_dir"] = args.step_latency_dir
    # the KV budget of each engine must hold one whole sequence: by default the longest this run makes (the
    # checkpoint's own limit, 131,072 for Llama-3.1, does not fit an 8 GiB budget)
    kwargs["max_model_len"] = args.max_model_len or args.input_len + args.output_len + 2 * args.k + 16
    if args.device == "cuda":  # two or three engines share the GPU: each a fixed KV budget, no prompt graphs
        kwargs.update(kv_cache_memory_gb=args.kv_cache_memory_gb, max_prefill_graph_tokens=0)
    return kwargs


def set_rates(book: OracleBook, prompts: list[list[int]], rates: list[float]) -> None:
    for prompt, rate in zip(prompts, rates):
        book.rates[tuple(prompt)] = rate


def run_part(args: argparse.Namespace, book: OracleBook, settings: dict[str, dict | None],
             rates_of: Callable[[int], list[float]]) -> list[dict]:
    llms = {name: engine(args, spec) for name, spec in settings.items()}
    vocab = book.vocab_size = llms["off"].engine.model_config.vocab_size
    rows = []
    for b in args.batch_sizes:
        prompts = make_prompts(b, args.input_len, vocab, args.seed + b)
        set_rates(book, prompts, rates_of(b))
        row: dict = {"batch": b}
        for name, llm in llms.items():  # "off" first: its outputs are the oracle's references
            decode_run(llm, prompts, min(args.output_len, 8))  # untimed: compiles, feeds the curve
            for _ in range(1 if name == "off" else args.learning_runs):  # untimed, whole: the oracle learns
                outputs, _ = decode_run(llm, prompts, args.output_len)
                for prompt, out in zip(prompts, outputs):
                    book.learn(prompt, out)
                    if name == "off":
                        book.references[tuple(prompt)] = out
        runs: dict[str, list[dict]] = {name: [] for name in llms}
        for _ in range(args.repeats):  # alternating, so a shared machine's load hits every setting alike
            for name, llm in llms.items():
                runs[name].append(timed(llm, prompts, args.output_len))
                for prompt, out in zip(prompts, runs[name][-1]["outputs"]):
                    book.learn(prompt, out)
        if args.profile_steps:
            for name, llm in llms.items():
                print(f"profile, batch {b}, {name}: {profile_steps(llm, prompts, args.profile_steps)}", flush=True)
        for name, results in runs.items():
            best = sorted(results, key=lambda r: r["tok_s"])[len(results) // 2]  # the median run
            row[name] = {k: v for k, v in best.items() if k != "outputs"}
            row[name]["identical"] = all(r["outputs"] == [book.references[tuple(p)] for p in prompts]
                                         for r in results)
        rows.append(row)
    for llm in llms.values():
        llm.engine.shutdown()
    return rows


def print_rows(title: str, rows: list[dict], names: list[str]) -> None:
    print(title)
    head = " | ".join(f"{n} tok/s" for n in names)
    extra = " | ".join(f"{n} verified/req-step | {n} accept len" for n in names if n != "off")
    print(f"| batch | {head} | " + " | ".join(f"{n}/off" for n in names if n != "off") + f" | {extra} | identical |")
    print("| --- " * (2 + 2 * (len(names) - 1) + 2 * (len(names) - 1)) + "| --- |")
    for r in rows:
        speeds = " | ".join(f"{r[n]['tok_s']:.1f}" for n in names)
        ratios = " | ".join(f"{r[n]['tok_s'] / r['off']['tok_s']:.2f}x" for n in names if n != "off")
        stats = " | ".join(f"{r[n]['verified_per_proposal']:.2f} | {r[n]['acceptance_length']:.2f}"
                           for n in names if n != "off")
        same = all(r[n]["identical"] for n in names)
        print(f"| {r['batch']} | {speeds} | {ratios} | {stats} | {same} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: the bundled SmolLM2)")
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights at the config's shapes)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--part", choices=("speedup", "confidence", "both"), default="both")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--rate", type=float, default=0.7, help="per-token acceptance of the speedup part")
    p.add_argument("--high", type=float, default=0.9, help="the confidence part: half the requests at this")
    p.add_argument("--low", type=float, default=0.3, help="and half at this")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a step's shape cannot flip a near-tie, so a bfloat16 run keeps "
                        "the speculation-off run's tokens (the oracle's references) on random weights")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting, alternating; the median kept")
    p.add_argument("--learning-runs", type=int, default=1,
                   help="untimed whole runs of each speculating engine before the timed ones: the oracle learns "
                        "the branches a bfloat16 run takes off the speculation-off run's path")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=8.0, help="CUDA: each engine's KV cache")
    p.add_argument("--step-latency-dir", default=None, help="where the curve is kept (default: the cache dir)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also profile this many steps of each engine per batch size (torch.profiler on CUDA, "
                        "cProfile of the host everywhere)")
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    book = OracleBook(vocab_size=0, seed=args.seed)
    install(book)
    spec = {"method": METHOD, "num_speculative_tokens": args.k}
    model = args.model or "SmolLM2-135M (bundled)"
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.part in ("speedup", "both"):
        settings = {"off": None, "on": spec}
        rows = run_part(args, book, settings, lambda b: [args.rate] * b)
        expected = sum(args.rate ** i for i in range(args.k + 1))  # 1 + r + ... + r^k
        print_rows(f"{model} {args.device} {args.dtype}: oracle drafts at {args.rate:.0%} per token, k={args.k}, "
                   f"in {args.input_len} / out {args.output_len}, expected acceptance length {expected:.2f}", rows,
                   list(settings))
        out["speedup"] = rows
    if args.part in ("confidence", "both"):
        settings = {"off": None, "on": spec, "confidence": {**spec, "confidence_scheduling": True}}
        rows = run_part(args, book, settings,
                        lambda b: [args.high if i % 2 == 0 else args.low for i in range(b)])
        print_rows(f"{model} {args.device} {args.dtype}: mixed acceptance (half {args.high:.0%}, half "
                   f"{args.low:.0%}), k={args.k}, in {args.input_len} / out {args.output_len}", rows,
                   list(settings))
        out["confidence"] = rows
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
