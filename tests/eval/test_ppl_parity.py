"""``dsinfer eval ppl`` and ``dsinfer eval parity`` on the tiny random Llama (vocab 256, no tokenizer: the bundled
text goes in as its UTF-8 bytes), against transformers on the same checkpoint in float32."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dsinfer.entrypoints.cli import main
from dsinfer.eval.parity import compare, random_prompts
from dsinfer.eval.ppl import Window, perplexity, transformers_perplexity, windows
from dsinfer.eval.reference import load_reference, reference_token_logprobs

SAMPLE = Path(__file__).resolve().parents[2] / "dsinfer" / "eval" / "data" / "ppl_sample.txt"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from dsinfer import LLM

    return LLM(str(tiny_llama_dir), dtype="float32"), load_reference(str(tiny_llama_dir))


def test_windows_score_every_token_after_the_first_once():
    assert windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert windows(5, 8, 4) == [Window(0, 5, 1)]
    with pytest.raises(ValueError, match="--stride must be in 1..--max-length"):
        windows(10, 4, 5)


def test_ppl_matches_transformers_on_the_bundled_text(tiny):
    llm, hf = tiny
    ids = list(SAMPLE.read_bytes()[:700])
    ours = perplexity(llm, ids, max_length=128, stride=64)
    assert ours.num_tokens == len(ids) - 1
    # transformers, position by position over the same windows: the same figure to float32 rounding
    nll = 0.0
    for w in windows(len(ids), 128, 64):
        logprobs, _ = reference_token_logprobs(hf, ids[w.begin:w.end])
        nll -= logprobs[w.first_scored - w.begin - 1:].sum()
    assert ours.value == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-5)
    # transformers' recipe as its docs write it (window losses weighted by labels less one): within 0.5%
    assert ours.value == pytest.approx(transformers_perplexity(hf, ids, 128, 64), rel=5e-3)


def test_parity_on_random_prompts_is_within_fp32_rounding(tiny):
    llm, hf = tiny
    rows = compare(llm, hf, random_prompts(3, 24, 256, seed=1))
    assert [r.num_tokens for r in rows] == [24, 24, 24]
    assert max(r.max_abs_diff for r in rows) <= 1e-4
    assert all(r.greedy_agree == r.num_positions for r in rows)


def test_parity_cli_prints_the_table_and_passes_the_threshold(tiny_llama_dir, capsys):
    assert main(["eval", "parity", "--model", str(tiny_llama_dir), "--random-prompts", "2", "--prompt-len", "16",
                 "--max-diff", "1e-4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["prompt", "tokens", "max", "|dlogp|", "mean", "|dlogp|", "greedy", "agree"]
    assert lines[-1].split()[:2] == ["all", "32"] and lines[-1].split()[-1] == "30/30"


def test_ppl_cli_tokenizes_the_file_with_the_models_tokenizer(smollm2_llm, capsys):
    ids = smollm2_llm.get_tokenizer().encode(SAMPLE.read_text())
    expected = perplexity(smollm2_llm, ids, max_length=96, stride=48)
    assert main(["eval", "ppl", str(SAMPLE), "--max-length", "96", "--stride", "48"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (f"dsinfer perplexity: {expected.value:.4f} ({len(ids) - 1} tokens scored, max length 96, "
                    "stride 48)")


def test_ppl_cli_refuses_a_checkpoint_without_tokenizer(tiny_llama_dir, capsys):
    assert main(["eval", "ppl", str(SAMPLE), "--model", str(tiny_llama_dir), "--max-length", "64",
                 "--stride", "32"]) == 2
    assert "needs the model's tokenizer; it has none" in capsys.readouterr().err


def test_parity_holds_for_the_tiny_deepseek_v2_too(tiny_deepseek_dir, capsys):
    """MLA, softmax MoE with shared experts and YaRN: within 1e-4 in float32 at every position."""
    assert main(["eval", "parity", "--model", str(tiny_deepseek_dir), "--random-prompts", "2", "--prompt-len", "16",
                 "--max-diff", "1e-4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "30/30"
