"""``dsinfer bench throughput`` and ``latency`` on the tiny random Llama: what they run and report (no timing is
asserted)."""

from __future__ import annotations

import json

import pytest

from dsinfer.bench.offline import LatencyResult, run_latency, run_throughput
from dsinfer.entrypoints.cli import main


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    from dsinfer import LLM

    return LLM(str(tiny_llama_dir), dtype="float32")


def test_throughput_counts_every_requested_token(tiny_llm):
    r = run_throughput(tiny_llm, num_prompts=3, input_len=8, output_len=5, warmup=1, iters=2, use_tqdm=False)
    assert (r.num_prompts, r.prompt_tokens, r.output_tokens) == (3, 24, 15)
    assert r.total_token_throughput == pytest.approx(39 / r.elapsed_s)


def test_latency_decode_step_is_the_full_run_less_the_prefill_over_the_later_steps():
    assert LatencyResult(4, 16, 11, prefill_ms=30.0, total_ms=80.0).decode_step_ms == pytest.approx(5.0)


def test_latency_needs_two_output_tokens(tiny_llm):
    with pytest.raises(ValueError, match="--output-len must be at least 2"):
        run_latency(tiny_llm, batch_size=2, input_len=8, output_len=1)


def test_bench_throughput_and_latency_clis_write_their_figures(tiny_llama_dir, tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "2", "--input-len", "6",
                 "--output-len", "3", "--disable-tqdm", "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["num_prompts"], figures["prompt_tokens"], figures["output_tokens"]) == (2, 12, 6)
    assert main(["bench", "latency", "--model", str(tiny_llama_dir), "--batch-size", "2", "--input-len", "6",
                 "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0", "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"batch_size", "input_len", "output_len", "prefill_ms", "decode_step_ms", "total_ms"}
    assert figures["prefill_ms"] > 0 and figures["total_ms"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["throughput", "--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
    (["throughput", "--output-len-range", "5", "2"], "--output-len-range needs 1 <= MIN <= MAX, got 5 2"),
    (["latency", "--batch-sizes", "4", "0"], "--batch-sizes must be at least 1, got 0"),
    (["latency", "--prefill", "--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_bad_offline_figures_are_refused_before_a_model_loads(args, message, capsys):
    from dsinfer.bench.cli import main as bench_main

    assert bench_main(args) == 2
    assert message in capsys.readouterr().err
