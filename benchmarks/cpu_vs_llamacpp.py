"""dsinfer against llama.cpp (and HF transformers) on CPU, the same GGUF, threads and prompt tokens, in one run.

    python benchmarks/cpu_vs_llamacpp.py [--threads 2] [--rounds 3] [--llamacpp-python /work/llamacpp-venv/bin/python]
        [--engines dsinfer llamacpp hf] [--dsinfer-args '{"quantization": "gguf"}'] [--gguf FILE]

Three measurements, each engine in its own subprocess (so thread settings do not leak) one after the other:
- ``decode``: one sequence, a short prompt, ``--decode-tokens`` greedy tokens: new tokens / wall time;
- ``prefill``: one 512-token prompt, one new token: prompt tokens / wall time;
- ``parallel``: ``--parallel`` sequences of distinct short prompts, ``--parallel-tokens`` greedy tokens each, all
  in flight together: the aggregate new tokens / wall time.
Every engine gets the same token ids (the bundled model's tokenizer), EOS ignored. llama.cpp is
llama-cpp-python built from source in a separate venv (a benchmark-only dependency: ``docs/benchmarks.md``
says how), driven through its low-level batch API so that its parallel sequences share each step. HF runs the
same GGUF dequantized to float32 (``gguf_file=``), the parallel case as one left-padded batch. Prints a table
and the ratios dsinfer / llama.cpp; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "salt, grain and cloth. Over the centuries it grew into a market town, then a regional capital. ")


def prompt_ids(gguf: Path, parallel: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer

    from dsinfer.models.loader.gguf import cached_gguf_dir

    tok = Tokenizer.from_file(str(cached_gguf_dir(gguf) / "tokenizer.json"))
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    long = encode(TEXT * 40)[:512]
    assert len(long) == 512
    short = [encode(f"Story number {i}: once upon a time, in a land far away,") for i in range(parallel)]
    return {"decode": short[0], "prefill": long, "parallel": short}


# ------------------------------------------------------------------------------------------------------------
# workers (each runs in its own process)


def run_dsinfer(ids: dict, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    os.environ["DSINFER_CPU_THREADS"] = str(args.threads)
    from dsinfer import LLM, SamplingParams

    # no prefix caching: the warm-up runs the measured prompts first
    llm = LLM(str(args.gguf), max_num_seqs=max(args.parallel, 1), enable_prefix_caching=False,
              **json.loads(args.dsinfer_args))

    def gen(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    gen([ids["decode"]], 8)  # warm-up
    gen([ids["prefill"]], 1)
    return {"decode": args.decode_tokens / gen([ids["decode"]], args.decode_tokens),
            "prefill": len(ids["prefill"]) / gen([ids["prefill"]], 1),
            "parallel": len(ids["parallel"]) * args.parallel_tokens / gen(ids["parallel"], args.parallel_tokens)}


def run_llamacpp(ids: dict, args: argparse.Namespace) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(args.gguf).encode(), mparams)
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 8192, 512, 512
    cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = max(args.parallel, 1), args.threads, args.threads
    cparams.kv_unified = True  # one KV buffer for all sequences (else each gets n_ctx / n_seq_max)
    ctx = L.llama_init_from_model(model, cparams)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, max(args.parallel, 1))

    def decode(entries):  # entries: (token, position, seq, wants_logits)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i):
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,)).argmax())

    def gen(prompts, n):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        start = time.perf_counter()
        # the prompts in batches of up to 512 tokens; each sequence's first token from its last prompt row
        entries = [(token, pos, seq, pos == len(prompt) - 1)
                   for seq, prompt in enumerate(prompts) for pos, token in enumerate(prompt)]
        tokens = [0] * len(prompts)
        for chunk in range(0, len(entries), 512):
            part = entries[chunk:chunk + 512]
            decode(part)
            for i, (_, _, seq, wants) in enumerate(part):
                if wants:
                    tokens[seq] = argmax(i)
        lengths = [len(p) for p in prompts]
        for step in range(1, n):
            decode([(tokens[s], lengths[s] + step - 1, s, True) for s in range(len(prompts))])
            tokens = [argmax(s) for s in range(len(prompts))]
        return time.perf_counter() - start

    gen([ids["decode"]], 8)
    gen([ids["prefill"]], 1)
    out = {"decode": args.decode_tokens / gen([ids["decode"]], args.decode_tokens),
           "prefill": len(ids["prefill"]) / gen([ids["prefill"]], 1),
           "parallel": len(ids["parallel"]) * args.parallel_tokens / gen(ids["parallel"], args.parallel_tokens)}
    L.llama_batch_free(batch)
    return out


def run_hf(ids: dict, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name,
                                                              dtype=torch.float32).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    @torch.inference_mode()
    def gen(prompts, n):
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start

    gen([ids["decode"]], 8)
    return {"decode": args.decode_tokens / gen([ids["decode"]], args.decode_tokens),
            "prefill": len(ids["prefill"]) / gen([ids["prefill"]], 1),
            "parallel": len(ids["parallel"]) * args.parallel_tokens / gen(ids["parallel"], args.parallel_tokens)}


WORKERS = {"dsinfer": run_dsinfer, "llamacpp": run_llamacpp, "hf": run_hf}


# ------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=["dsinfer", "llamacpp", "hf"], choices=sorted(WORKERS))
    p.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python",
                   help="the interpreter of the venv holding llama-cpp-python")
    p.add_argument("--dsinfer-args", default="{}", help="JSON of extra LLM() arguments")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--parallel", type=int, default=32)
    p.add_argument("--parallel-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="runs of every engine, alternating; medians reported")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _run_worker(engine: str, ids_path: Path, args: argparse.Namespace) -> dict | None:
    """One engine's three measurements in its own process; None (with its stderr printed) if it failed."""
    python = args.llamacpp_python if engine == "llamacpp" else sys.executable
    cmd = [python, __file__, "--worker", engine, "--ids", str(ids_path), "--gguf", str(args.gguf),
           "--threads", str(args.threads), "--dsinfer-args", args.dsinfer_args, "--decode-tokens",
           str(args.decode_tokens), "--parallel", str(args.parallel), "--parallel-tokens",
           str(args.parallel_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(f"{engine}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.gguf is None:
        sys.path.insert(0, str(ROOT))
        from dsinfer.models.loader.gguf import default_model_path

        args.gguf = default_model_path()
    if args.worker:
        result = WORKERS[args.worker](json.loads(args.ids.read_text()), args)
        print("RESULT " + json.dumps(result))
        return 0
    ids_path = Path(f"/tmp/cpu_vs_llamacpp_ids_{os.getpid()}.json")
    ids_path.write_text(json.dumps(prompt_ids(args.gguf, args.parallel)))
    rounds: dict[str, list[dict]] = {engine: [] for engine in args.engines}
    for r in range(args.rounds):  # engines alternate their order round by round: a shared machine's load spreads
        for engine in (args.engines if r % 2 == 0 else args.engines[::-1]):
            result = _run_worker(engine, ids_path, args)
            if result is not None:
                rounds[engine].append(result)
                print(f"round {r + 1} {engine:9s} " + "  ".join(f"{k} {v:8.1f} tok/s" for k, v in result.items()),
                      flush=True)
    ids_path.unlink(missing_ok=True)
    results: dict = {engine: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
                     for engine, runs in rounds.items() if runs}
    results["rounds"] = rounds
    for engine in args.engines:
        if engine in results:
            print(f"median {engine:9s} " + "  ".join(f"{k} {v:8.1f} tok/s" for k, v in results[engine].items()))
    if "dsinfer" in results and "llamacpp" in results:
        ratios = {k: results["dsinfer"][k] / results["llamacpp"][k] for k in results["dsinfer"]}
        results["ratio_dsinfer_llamacpp"] = ratios
        print("dsinfer / llama.cpp (medians): " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        paired = list(zip(rounds["dsinfer"], rounds["llamacpp"]))
        for k in ratios:
            print(f"  {k}: per round " + ", ".join(f"{a[k] / b[k]:.2f}x" for a, b in paired))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if any(rounds.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
