"""Multi-turn chat against the KV store: prefill tokens computed and TTFT with the store off, host, directory.

    python benchmarks/kvstore_multiturn.py [--conversations 8] [--turns 4] [--system 512] [--user 64]
                                           [--answer 32] [--num-kv-blocks 96] [--grain 128] [--model DIR]
                                           [--modes off,host,dir] [--dir PATH] [--json-out F]
    # the issue's full size (GPU): --conversations 64 --turns 8 --system 4096 --num-kv-blocks <what the GPU holds>

C conversations share one system prompt; each turn appends a user message (random token ids) to the
conversation's history (prompt + the model's answers so far) and asks for ``--answer`` greedy tokens. Turn t of
every conversation is submitted at once, then turn t + 1. The GPU cache (``--num-kv-blocks``) is sized to hold far
less than every history, so between turns the prefix cache forgets most conversations: with the store off their
history is recomputed; with it, loaded (``host``: pinned host memory; ``dir``: a directory, the host tier off).
Reported per mode: prompt tokens, prefill tokens computed (prompt tokens - cached tokens, GPU hits included),
TTFT p50 / p99 (arrival to first token), wall time, the process's CPU time (every thread: steadier than wall
time on a shared machine), store hits by tier; every mode's answers must be identical.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer import LLM, SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_mode(args: argparse.Namespace, mode: str, store_dir: str) -> dict:
    kv_store = {"off": None, "host": {"host_gb": args.host_gb, "grain": args.grain},
                "dir": {"dir": store_dir, "grain": args.grain}}[mode]
    llm = LLM(args.model, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              kv_store=kv_store, **({"dtype": "float32"} if args.model is None else {}))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(args.system)]
    histories = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    ttfts, answers = [], []
    prompt_tokens = cached = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.turns):
        for history in histories:
            history += [rng.randrange(vocab) for _ in range(args.user)]
        outs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
        for history, out in zip(histories, outs):
            m = out.metrics
            ttfts.append(m.first_token_time - m.arrival_time)
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            history += out.outputs[0].token_ids
            answers.append(list(out.outputs[0].token_ids))
        if kv_store is not None:
            llm.engine.flush_kv_store()  # the next turn's requests see every save (the write-behind is async)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = llm.engine.kv_store_stats() or {}
    llm.engine.shutdown()
    return {"mode": mode, "prompt_tokens": prompt_tokens, "prefill_computed": prompt_tokens - cached,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
            "wall_s": wall, "cpu_s": cpu, "hit_tokens_host": stats.get("hit_tokens_host", 0),
            "hit_tokens_dir": stats.get("hit_tokens_dir", 0), "queue_drops": stats.get("queue_drops", 0),
            "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2, float32)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=512, help="shared system prompt tokens")
    parser.add_argument("--user", type=int, default=64, help="tokens each user message adds")
    parser.add_argument("--answer", type=int, default=32, help="tokens each answer adds")
    parser.add_argument("--num-kv-blocks", type=int, default=96, help="the GPU cache's blocks (16 tokens each)")
    parser.add_argument("--max-model-len", type=int, default=1280)
    parser.add_argument("--grain", type=int, default=128)
    parser.add_argument("--host-gb", type=float, default=1.0)
    parser.add_argument("--modes", default="off,host,dir")
    parser.add_argument("--dir", default=None, help="the directory tier's path (default: a fresh temporary one)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    results = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as store_dir:
            results.append(run_mode(args, mode, store_dir))
        r = results[-1]
        print(f"{mode:5s} prompt {r['prompt_tokens']:7d}  prefill computed {r['prefill_computed']:7d}  TTFT p50 "
              f"{r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms  wall {r['wall_s']:6.1f} s  cpu "
              f"{r['cpu_s']:6.1f} s  hits host "
              f"{r['hit_tokens_host']:.0f} dir {r['hit_tokens_dir']:.0f}  drops {r['queue_drops']:.0f}", flush=True)
    same = all(r["answers"] == results[0]["answers"] for r in results)
    print(f"answers identical across modes: {'yes' if same else 'NO'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([{k: v for k, v in r.items() if k != "answers"} for r in results],
                                                  indent=1))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
