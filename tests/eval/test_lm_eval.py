"""lm-eval-harness against a live dsinfer server on local tasks: ``local-completions`` (echo + logprobs for
loglikelihood) on a multiple-choice task, whose per-choice log-likelihoods equal the engine's own prompt logprobs,
and ``local-chat-completions`` on a generation task, whose answers are the server's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from dsinfer.eval.scoring import score_sequences
from tests.server.live_server import API_KEY, start_server, stop_server

lm_eval = pytest.importorskip("lm_eval")
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("lm_eval_server"), "--dtype", "float32")
    yield server
    stop_server(server)


def _task_dir(tmp_path: Path, monkeypatch) -> Path:
    """The task YAMLs in ``tmp_path/task``, their data files in the working directory, which they name them from."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    task_dir = shutil.copytree(TASK_DIR, tmp_path / "task")
    for data in task_dir.glob("*.jsonl"):
        shutil.copy(data, tmp_path / data.name)
    return task_dir


def _tasks(task_dir: Path):
    """Only our tasks: lm-eval's own index of thousands of task YAMLs takes most of a run to build."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def _tokenizer_dir(llm, path: Path) -> Path:
    """The engine's tokenizer as a transformers tokenizer directory (lm-eval tokenizes the requests itself)."""
    tok = llm.get_tokenizer()
    path.mkdir()
    tok.backend_tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.slow  # importing lm-eval and datasets takes most of its ~10 s
def test_lm_eval_local_completions_loglikelihoods_are_the_engines(live, smollm2_llm, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate

    task_dir = _task_dir(tmp_path, monkeypatch)
    tokenizer = _tokenizer_dir(smollm2_llm, tmp_path / "tokenizer")
    served = httpx.get(f"{live.v1}/models", headers=live.headers(), timeout=30).json()["data"][0]["id"]
    results = simple_evaluate(
        model="local-completions",
        model_args=f"model={served},base_url={live.v1}/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={tokenizer},num_concurrent=1,max_retries=1,tokenized_requests=True",
        tasks=["dsinfer_tiny_mc"], task_manager=_tasks(task_dir), log_samples=True)
    samples = results["samples"]["dsinfer_tiny_mc"]
    assert len(samples) == 3
    tok = smollm2_llm.get_tokenizer()
    for sample in samples:
        context = sample["arguments"][0][0]  # one (context, continuation) pair per choice
        continuations = [pair[1] for pair in sample["arguments"]]
        assert len(continuations) == 3 and context.endswith("\nA:")
        theirs = [float(resp[0][0]) for resp in sample["resps"]]
        ctx = tok.encode(context, add_special_tokens=False)
        wholes = [tok.encode(context + c, add_special_tokens=False) for c in continuations]
        ours = [float(s.logprobs[len(ctx) - 1:].sum()) for s in score_sequences(smollm2_llm, wholes)]
        assert theirs == pytest.approx(ours, abs=1e-4)
    assert results["results"]["dsinfer_tiny_mc"]["acc,none"] == pytest.approx(
        sum(s["acc"] for s in samples) / 3)


@pytest.mark.slow
def test_lm_eval_local_chat_completions_generations_are_the_servers(live, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate

    task_dir = _task_dir(tmp_path, monkeypatch)
    served = httpx.get(f"{live.v1}/models", headers=live.headers(), timeout=30).json()["data"][0]["id"]
    results = simple_evaluate(
        model="local-chat-completions",
        model_args=f"model={served},base_url={live.v1}/chat/completions,num_concurrent=1,max_retries=1",
        tasks=["dsinfer_tiny_chat"], task_manager=_tasks(task_dir), log_samples=True,
        apply_chat_template=True)
    samples = results["samples"]["dsinfer_tiny_chat"]
    assert len(samples) == 2
    for sample in samples:
        question = sample["doc"]["question"] + " Answer with one word."
        answer = live.post("/v1/chat/completions", json={
            "model": served, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
            "temperature": 0.0, "stop": ["\n"]}).json()["choices"][0]["message"]["content"]
        assert sample["resps"][0][0] == answer
    matches = sum(s["exact_match"] for s in samples)
    assert results["results"]["dsinfer_tiny_chat"]["exact_match,none"] == pytest.approx(matches / 2)
