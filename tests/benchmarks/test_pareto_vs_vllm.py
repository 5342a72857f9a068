"""``benchmarks/pareto_vs_vllm.py``: the model directory both engines load (config, weights, a word-level tokenizer
whose every id decodes to text), the two servers' matched settings, and a whole sweep of our CPU server."""

from __future__ import annotations

import json

import pytest

from benchmarks.pareto_vs_vllm import main, model_dir, parse_args, server_command


def test_the_model_directory_links_the_checkpoint_and_gets_a_word_tokenizer(tiny_llama_dir, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out, vocab = model_dir(tiny_llama_dir, None, tmp_path)
    assert vocab == 256 and (out / "config.json").is_symlink() and any(out.glob("*.safetensors"))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [0, 17, 255]
    assert tok.decode(ids) == "w0 w17 w255" and tok.encode("w0 w17 w255").ids == ids
    hf = AutoTokenizer.from_pretrained(out)  # what vLLM loads
    assert len(hf) == 256 and hf.eos_token == "w2"  # the config's eos_token_id
    assert hf.decode([5, 9]) == "w5 w9"


def test_both_servers_get_the_same_settings(tmp_path):
    args = parse_args(["--model", "m", "--result-dir", str(tmp_path), "--max-model-len", "4096",
                       "--max-num-seqs", "64"])
    ours, theirs = (server_command(engine, tmp_path, 8123, args) for engine in ("dsinfer", "vllm"))
    assert ours[1:4] == ["-m", "dsinfer", "serve"] and theirs[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    shared = ["--port", "8123", "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "64",
              "--served-model-name", "bench", "--gpu-memory-utilization", "0.85", "--load-format", "dummy"]
    for cmd in (ours, theirs):
        assert " ".join(shared) in " ".join(cmd)


def test_a_cpu_sweep_of_our_server_writes_its_points_and_the_png(tiny_llama_dir, tmp_path):
    pytest.importorskip("matplotlib")
    result_dir = tmp_path / "results"
    rc = main(["--model", str(tiny_llama_dir), "--engines", "dsinfer", "--concurrencies", "1,2",
               "--prompts-per-concurrency", "1", "--min-prompts", "2", "--input-len", "16", "--output-len", "4",
               "--max-model-len", "64", "--max-num-seqs", "4", "--gpu-memory-utilization", "0",
               "--result-dir", str(result_dir), "--work-dir", str(tmp_path / "work"), "--start-timeout", "120"])
    assert rc == 0
    points = [json.loads((result_dir / f"dsinfer-infqps-c{c}.json").read_text()) for c in (1, 2)]
    assert [(p["max_concurrency"], p["completed"], p["failed"]) for p in points] == [(1, 2, 0), (2, 2, 0)]
    assert all(p["total_output_tokens"] == 8 for p in points)
    assert (result_dir / "pareto.png").read_bytes()[:4] == b"\x89PNG"
