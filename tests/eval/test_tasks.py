"""``dsinfer eval tasks``: the bundled task set, saved generations scored in a separate step, the scoring rules."""

from __future__ import annotations

import json

import pytest

from dsinfer.entrypoints.cli import main
from dsinfer.eval.cli import DEFAULT_TASK
from dsinfer.eval.tasks import is_correct, last_number, load_task, normalize, run_task, score_dir


def test_bundled_set_has_fifty_items_under_every_rule():
    task = load_task(DEFAULT_TASK)
    assert len(task.items) == 50
    assert task.header.stop == ("\n",)
    assert {it.get("scoring", "choice") for it in task.items} == {"numeric", "exact", "choice"}
    assert task.header.prompt(task.items[0]).endswith("Q: What is 3 + 4?\nA:")


def test_scoring_rules():
    assert normalize(" The  Pacific Ocean!") == "pacific ocean"
    assert last_number("7 + 5 = 12.") == 12.0 and last_number("1,000 apples") == 1000.0 and last_number("no") is None
    assert is_correct({"scoring": "numeric", "answer": "12", "output": "7 + 5 = 12"})
    assert not is_correct({"scoring": "numeric", "answer": "12", "output": "12 + 1 = 13"})
    assert is_correct({"scoring": "exact", "answer": ["Shakespeare", "William Shakespeare"], "output": " shakespeare."})
    assert not is_correct({"scoring": "exact", "answer": "Paris", "output": "Paris, France"})
    assert is_correct({"scoring": "choice", "answer": 1, "choice_logprobs": [-3.0, -1.0, -2.0]})


def test_bad_items_are_refused_with_their_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"type": "choice", "question": "q", "choices": ["a"], "answer": 3}) + "\n")
    with pytest.raises(ValueError, match="item 1: a choice item needs 'choices' and 'answer'"):
        load_task(path)
    path.write_text(json.dumps({"type": "generate", "question": "q", "answer": "a", "scoring": "fuzzy"}) + "\n")
    with pytest.raises(ValueError, match="scoring must be exact or numeric, got 'fuzzy'"):
        load_task(path)


def test_generations_are_saved_then_rescored_without_the_model(smollm2_llm, tmp_path, capsys):
    task = load_task(DEFAULT_TASK)
    task.items = [it for it in task.items if it["id"] in ("arith-1", "arith-6", "choice-1")]
    path = run_task(smollm2_llm, task, tmp_path, use_tqdm=False)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == ["arith-1", "arith-6", "choice-1"]
    assert records[0]["output"] == " 7" and records[0]["prompt"].endswith("Q: What is 3 + 4?\nA:")
    assert len(records[2]["choice_logprobs"]) == 3
    scores = score_dir(tmp_path)
    assert [g["correct"] for g in scores["items"]] == [True, records[1]["output"].strip() == "4", True]
    records[1]["output"] = " 4"  # rescoring reads only the saved file
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["eval", "score", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:2] == ["all", "3/3"]
    assert json.loads((tmp_path / "scores.json").read_text())["accuracy"] == 1.0
