"""One serving sweep per engine, dsinfer's server and vLLM's (`vllm serve`), back to back on one GPU, drawn in one
Pareto PNG (output tokens/s per GPU against tokens/s per user).

    python3 benchmarks/pareto_vs_vllm.py --model benchmarks/configs/llama-3.1-8b --engines dsinfer vllm \\
        --concurrencies 1,4,16,64,128,256 --result-dir $OUT/pareto-llama

Each engine is started with the same settings (bf16, ``--max-model-len``, ``--max-num-seqs``,
``--gpu-memory-utilization``, its own defaults otherwise), waited for at /health, swept with ``dsinfer bench
sweep``'s client (the same client and the same random token-id prompts for both: point i's prompts are seeded
with i) and stopped before the next starts. A config-only model directory (benchmarks/configs/*) runs with
dummy weights (``--ckpt DIR`` of safetensors instead: a MoE model needs realistic routing, see
../shared/tools/peer-vllm/README.md) and a word-level tokenizer written here, one word per id, so every streamed
token carries text for both engines. vLLM comes from the wheels of ../shared/tools/peer-vllm (on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer.bench.datasets import random_requests  # noqa: E402
from dsinfer.bench.pareto import load_points, pareto_frontier, plot_pareto  # noqa: E402
from dsinfer.bench.serve import ServeConfig  # noqa: E402
from dsinfer.bench.sweep import parse_grid, run_sweep, sweep_points  # noqa: E402
from dsinfer.router.launch import Launched, free_port, stop, wait_healthy  # noqa: E402


def write_word_tokenizer(directory: Path, vocab_size: int, bos: int | None, eos: int | None) -> None:
    """A tokenizer of ``vocab_size`` words ``w0 .. w{n-1}``: each id decodes to text (EOS, named so that the
    engines know it, decodes to nothing; the sweep ignores EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    config |= {name: f"w{i}" for name, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def model_dir(config_dir: Path, ckpt: Path | None, work: Path) -> tuple[Path, int]:
    """A directory both engines load: the config, the checkpoint's weights (links) when given, the tokenizer."""
    out = work / "model"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    source = ckpt or config_dir
    for f in source.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((out / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    write_word_tokenizer(out, config["vocab_size"], config.get("bos_token_id"), eos)
    return out, config["vocab_size"]


def server_command(engine: str, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    common = ["--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "bench"]
    if args.gpu_memory_utilization:
        common += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    common += ["--load-format", "auto" if args.ckpt else "dummy"]
    if engine == "dsinfer":
        return [sys.executable, "-m", "dsinfer", "serve", str(model), *common, "--disable-log-requests"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *common]


def sweep_engine(engine: str, model: Path, vocab: int, args: argparse.Namespace) -> float:
    """Start one engine's server, sweep it, stop it; -> seconds it took to become healthy. Started, waited for
    and stopped as the router's launched replicas are (``router.launch``), in a process group of its own whose
    leftovers are killed after (vLLM's engine core is a child process that would keep the GPU's memory)."""
    port = args.port or free_port()
    server = Launched(f"http://127.0.0.1:{port}", engine, None, args.result_dir / f"{engine}-server.log")
    t0 = time.monotonic()
    with server.log.open("w") as out:
        server.proc = subprocess.Popen(server_command(engine, model, port, args), stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       env=os.environ | {"VLLM_NO_USAGE_STATS": "1"})
    try:
        wait_healthy([server], args.start_timeout)
        started = time.monotonic() - t0
        print(f"{engine}: healthy after {started:.0f} s", flush=True)
        concurrencies = parse_grid(args.concurrencies, int, "--concurrencies")
        cfg = ServeConfig(server.url, "bench", float("inf"), 1.0, None, args.seed, None, 900.0, True, 0.0, False)

        def requests_for(i: int):
            return random_requests(max(args.prompts_per_concurrency * concurrencies[i], args.min_prompts),
                                   args.input_len, args.output_len, min(vocab, 32000), args.seed + i)

        run_sweep(cfg, requests_for, sweep_points(None, concurrencies), {}, args.label_prefix + engine, 1,
                  "random", args.result_dir)
        return started
    finally:
        stop([server])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a config directory (dummy weights) or with --ckpt")
    p.add_argument("--ckpt", type=Path, default=None, help="safetensors weights for --model's config")
    p.add_argument("--engines", nargs="+", choices=("dsinfer", "vllm"), default=["dsinfer", "vllm"])
    p.add_argument("--concurrencies", default="1,4,16,64,128,256")
    p.add_argument("--prompts-per-concurrency", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="0: not passed (a CPU run)")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--label-prefix", default="", help="e.g. 'llama-3.1-8b ' (the plot's curve names)")
    p.add_argument("--result-dir", type=Path, required=True, help="one JSON per point, the logs, pareto.png")
    p.add_argument("--title", default="")
    p.add_argument("--work-dir", type=Path, default=None, help="where the model directory is made (default: TMPDIR)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "pareto-vs-vllm"
    model, vocab = model_dir(args.model, args.ckpt, work)
    failed = []
    for engine in args.engines:
        try:
            sweep_engine(engine, model, vocab, args)
        except Exception as exc:  # one engine failing to start still leaves the other's curve
            print(f"{engine}: FAILED: {exc}", flush=True)
            failed.append(engine)
    points = load_points([args.result_dir])
    png = plot_pareto(points, args.result_dir / "pareto.png", args.title)
    for p in sorted(points, key=lambda p: (p.label, p.knob_value)):
        print(f"| {p.label} | {p.knob} | {p.per_user:.1f} tok/s/user | {p.per_gpu:.1f} tok/s/GPU |")
    for p in pareto_frontier(points):
        print(f"frontier: {p.label} {p.knob}")
    print(f"wrote {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
