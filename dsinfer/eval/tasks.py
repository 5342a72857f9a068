"""``dsinfer eval tasks``: multiple-choice and generation tasks from a local JSONL file, in two steps: ``run``
saves every generation (and every choice's log-likelihood) to disk, ``score`` grades what was saved and can be
re-run with nothing but that file.

The task file (``docs/eval.md`` documents it; ``dsinfer/eval/data/basic.jsonl`` is one). Its optional first line
is the task's header, ``{"type": "task", ...}`` with ``name``, ``prompt_prefix`` (e.g. few-shot examples),
``prompt_template`` (default ``"{question}"``), ``stop`` and ``max_tokens`` for generations. Every other line is an
item:

- ``{"id": "add-1", "type": "generate", "question": "What is 2 + 3?", "answer": "5", "scoring": "numeric"}``;
  ``scoring`` is ``exact`` (normalized text equal to an answer; ``answer`` may be a list of accepted ones) or
  ``numeric`` (the last number in the output equals the answer);
- ``{"id": "mc-1", "type": "choice", "question": "...", "choices": [" Paris", " Rome"], "answer": 0}``: the
  choice whose continuation of the prompt has the highest log-likelihood is the model's answer."""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsinfer.eval.scoring import score_sequences

GENERATIONS = "generations.jsonl"
SCORES = "scores.json"
SCORINGS = ("exact", "numeric", "choice")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class TaskHeader:
    name: str = "task"
    prompt_prefix: str = ""
    prompt_template: str = "{question}"
    stop: tuple[str, ...] = ()
    max_tokens: int = 32

    def prompt(self, item: dict) -> str:
        return self.prompt_prefix + self.prompt_template.format(question=item["question"])


@dataclass
class Task:
    header: TaskHeader
    items: list[dict[str, Any]] = field(default_factory=list)


def load_task(path: str | Path) -> Task:
    """Parse and check a task file."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    header = TaskHeader()
    if rows and rows[0].get("type") == "task":
        meta = {k: v for k, v in rows.pop(0).items() if k != "type"}
        meta["stop"] = tuple(meta.get("stop", ()))
        header = TaskHeader(**meta)
    for n, item in enumerate(rows, 1):
        _check_item(path, n, item)
    if not rows:
        raise ValueError(f"{path} holds no items")
    return Task(header, rows)


def _check_item(path, n: int, item: dict) -> None:
    kind = item.get("type")
    if kind == "choice":
        if not isinstance(item.get("answer"), int) or not 0 <= item["answer"] < len(item.get("choices", [])):
            raise ValueError(f"{path} item {n}: a choice item needs 'choices' and 'answer' (an index into them)")
    elif kind == "generate":
        if item.get("scoring", "exact") not in ("exact", "numeric"):
            raise ValueError(f"{path} item {n}: scoring must be exact or numeric, got {item['scoring']!r}")
    else:
        raise ValueError(f"{path} item {n}: type must be 'generate' or 'choice', got {kind!r}")
    if "question" not in item or "answer" not in item:
        raise ValueError(f"{path} item {n}: 'question' and 'answer' are required")


def run_task(llm, task: Task, output_dir: str | Path, use_tqdm: bool = True) -> Path:
    """Generate (greedy) for every generation item and score every choice; write one JSON line per item."""
    from dsinfer.engine.sampling_params import SamplingParams

    gen = [it for it in task.items if it["type"] == "generate"]
    params = SamplingParams(max_tokens=task.header.max_tokens, temperature=0.0, stop=list(task.header.stop))
    outputs = llm.generate([task.header.prompt(it) for it in gen], params, use_tqdm=use_tqdm) if gen else []
    texts = {id(it): out.outputs[0].text for it, out in zip(gen, outputs)}
    choice_logprobs = _choice_logprobs(llm, task, [it for it in task.items if it["type"] == "choice"])
    records = []
    for n, item in enumerate(task.items):
        record = {"id": item.get("id", n), "type": item["type"], "scoring": item.get("scoring", "exact"),
                  "prompt": task.header.prompt(item), "answer": item["answer"]}
        if item["type"] == "generate":
            record["output"] = texts[id(item)]
        else:
            record |= {"scoring": "choice", "choices": item["choices"], "choice_logprobs": choice_logprobs[id(item)]}
        records.append(record)
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / GENERATIONS
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _choice_logprobs(llm, task: Task, items: list[dict]) -> dict[int, list[float]]:
    """Per choice item, each choice's summed logprob as the continuation of the item's prompt."""
    tokenizer = llm.get_tokenizer()
    if items and tokenizer is None:
        raise ValueError("choice items need the model's tokenizer; this checkpoint has none")
    sequences, spans = [], []
    for item in items:
        context = tokenizer.encode(task.header.prompt(item))
        for choice in item["choices"]:
            sequences.append(context + tokenizer.encode(choice, add_special_tokens=False))
            spans.append((id(item), len(context)))
    out: dict[int, list[float]] = {id(item): [] for item in items}
    for (key, start), scores in zip(spans, score_sequences(llm, sequences) if sequences else []):
        out[key].append(float(scores.logprobs[start - 1:].sum()))
    return out


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def last_number(text: str) -> float | None:
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


def is_correct(record: dict) -> bool:
    """Grade one saved record by its scoring rule."""
    if record["scoring"] == "choice":
        lps = record["choice_logprobs"]
        return max(range(len(lps)), key=lps.__getitem__) == record["answer"]
    if record["scoring"] == "numeric":
        got = last_number(record["output"])
        return got is not None and abs(got - float(record["answer"])) <= 1e-6 * max(1.0, abs(got))
    answers = record["answer"] if isinstance(record["answer"], list) else [record["answer"]]
    return normalize(record["output"]) in {normalize(str(a)) for a in answers}


def score_dir(output_dir: str | Path) -> dict:
    """Grade the saved generations; write ``scores.json`` (totals per scoring rule and each item's grade)."""
    directory = Path(output_dir)
    path = directory / GENERATIONS
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dsinfer eval tasks FILE --output-dir {directory}` first")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    graded = [{"id": r["id"], "scoring": r["scoring"], "correct": is_correct(r)} for r in records]
    by_rule = {}
    for rule in SCORINGS:
        mine = [g for g in graded if g["scoring"] == rule]
        if mine:
            by_rule[rule] = {"correct": sum(g["correct"] for g in mine), "total": len(mine)}
    correct = sum(g["correct"] for g in graded)
    scores = {"correct": correct, "total": len(graded), "accuracy": correct / len(graded), "by_scoring": by_rule,
              "items": graded}
    (directory / SCORES).write_text(json.dumps(scores, indent=1) + "\n")
    return scores


def format_scores(scores: dict) -> str:
    lines = [f"{rule:<8} {s['correct']:>4}/{s['total']:<4} {s['correct'] / s['total']:.1%}"
             for rule, s in scores["by_scoring"].items()]
    lines.append(f"{'all':<8} {scores['correct']:>4}/{scores['total']:<4} {scores['accuracy']:.1%}")
    return "\n".join(lines)
