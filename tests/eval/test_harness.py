"""lm-eval task YAMLs over local data through the engine in this process (``dsinfer eval tasks FILE.yaml``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")

from dsinfer.engine.sampling_params import SamplingParams  # noqa: E402
from dsinfer.eval.harness import DsinferLM, run_lm_eval_task  # noqa: E402
from dsinfer.eval.scoring import score_sequences  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.mark.slow  # importing lm-eval and datasets takes most of it
def test_multiple_choice_yaml_scores_each_choice_by_the_engines_logprobs(smollm2_llm, tmp_path):
    results = run_lm_eval_task(smollm2_llm, TASK_DIR / "dsinfer_tiny_mc.yaml", tmp_path)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3
    tok = smollm2_llm.get_tokenizer()
    for sample in samples:
        context = sample["arguments"][0][0]
        ctx = tok.encode(context, add_special_tokens=False)
        wholes = [tok.encode(context + pair[1], add_special_tokens=False) for pair in sample["arguments"]]
        ours = [float(s.logprobs[len(ctx) - 1:].sum()) for s in score_sequences(smollm2_llm, wholes)]
        assert [float(r[0][0]) for r in sample["resps"]] == pytest.approx(ours, abs=1e-9)
    acc = json.loads((tmp_path / "results.json").read_text())["dsinfer_tiny_mc"]["acc,none"]
    assert acc == results["results"]["dsinfer_tiny_mc"]["acc,none"] == pytest.approx(
        sum(s["acc"] for s in samples) / 3)


def test_generate_until_is_greedy_with_until_as_stop_strings(smollm2_llm):
    lm = DsinferLM(smollm2_llm, use_tqdm=False)
    prompt = "Q: What is the capital of France?\nA:"
    got = lm.generate_until([SimpleNamespace(args=(prompt, {"until": ["\n"], "max_gen_toks": 8}))])
    expected = smollm2_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]),
                                    use_tqdm=False)[0].outputs[0].text
    assert got == [expected] and "\n" not in expected


def test_loglikelihood_rolling_scores_every_token_once_after_bos(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    text = "The lamp is lit again at dusk, and the beam sweeps the water once every ten seconds."
    ids = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id,
           *tok.encode(text, add_special_tokens=False)]
    whole = float(score_sequences(smollm2_llm, [ids])[0].logprobs.sum())
    req = SimpleNamespace(args=(text,))
    assert DsinferLM(smollm2_llm, max_length=1024, use_tqdm=False).loglikelihood_rolling([req]) == [
        pytest.approx(whole, abs=1e-9)]
    # shorter windows keep every token but give later ones less context: a different, finite figure
    short = DsinferLM(smollm2_llm, max_length=8, use_tqdm=False).loglikelihood_rolling([req])[0]
    assert short < 0 and short != pytest.approx(whole, abs=1e-3)
