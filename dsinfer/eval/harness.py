"""lm-eval-harness tasks (YAMLs over local data) run through the engine in this process: ``DsinferLM`` is an
lm-eval ``LM`` over ``LLM``, scored by lm-eval's own metrics.

loglikelihood: the continuation's summed prompt logprobs after the context (trailing spaces of the context move to
the continuation, as lm-eval's own backends do); greedy when every continuation token ranks first.
loglikelihood_rolling: the text after the model's BOS (or EOS) in disjoint windows of ``max_length`` tokens, each
token scored once. generate_until: greedy unless ``do_sample``, ``until`` as stop strings, ``max_gen_toks``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from lm_eval.api.model import LM

from dsinfer.eval.ppl import windows
from dsinfer.eval.scoring import score_sequences


class DsinferLM(LM):
    def __init__(self, llm, max_length: int = 2048, use_tqdm: bool = True):
        super().__init__()
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        if self.tokenizer is None:
            raise ValueError("lm-eval tasks need the model's tokenizer; this checkpoint has none")
        self.max_length = max_length
        self.use_tqdm = use_tqdm

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prefix_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self._encode(context) if context else [self._prefix_id()]
        whole = self._encode(context + continuation) if context else context_ids + self._encode(continuation)
        return context_ids, whole[len(context_ids):]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._split(*req.args) for req in requests]
        sequences = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in pairs]
        out = []
        for (_, cont), seq, scores in zip(pairs, sequences, score_sequences(self.llm, sequences, self.use_tqdm)):
            start = len(seq) - len(cont) - 1  # logprobs[j] is the token at position j + 1
            out.append((float(scores.logprobs[start:].sum()), scores.top_ids[start:].tolist() == cont))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in requests:
            ids = [self._prefix_id(), *self._encode(req.args[0])]
            spans = windows(len(ids), self.max_length, self.max_length)
            scores = score_sequences(self.llm, [ids[w.begin:w.end] for w in spans])
            out.append(sum(float(s.logprobs[w.first_scored - w.begin - 1:].sum()) for w, s in zip(spans, scores)))
        return out

    def generate_until(self, requests) -> list[str]:
        from dsinfer.engine.sampling_params import SamplingParams

        prompts, params = [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            sample = kwargs.pop("do_sample", False)
            params.append(SamplingParams(max_tokens=int(kwargs.pop("max_gen_toks", 256)),
                                         temperature=float(kwargs.pop("temperature", 1.0 if sample else 0.0)),
                                         stop=[until] if isinstance(until, str) else list(until)))
            prompts.append(context)
        return [o.outputs[0].text for o in self.llm.generate(prompts, params, use_tqdm=self.use_tqdm)]


def run_lm_eval_task(llm, yaml_path: str | Path, output_dir: str | Path, limit: int | None = None) -> dict:
    """Run the task a YAML defines (relative data paths are the YAML's directory's); write ``results.json`` and
    every sample lm-eval logged to ``samples.jsonl``; return lm-eval's results."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    yaml_path = Path(yaml_path).resolve()
    name = _task_name(yaml_path)
    with contextlib.chdir(yaml_path.parent):
        results = simple_evaluate(model=DsinferLM(llm), tasks=[name], limit=limit, log_samples=True,
                                  task_manager=TaskManager(include_path=str(yaml_path.parent),
                                                           include_defaults=False))
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(results["results"], indent=1, default=str) + "\n")
    samples = results["samples"][name]
    (directory / "samples.jsonl").write_text("".join(json.dumps(s, default=str) + "\n" for s in samples))
    return results


def _task_name(yaml_path: Path) -> str:
    for line in yaml_path.read_text().splitlines():
        if line.startswith("task:"):
            return line.split(":", 1)[1].strip().strip("'\"")
    raise ValueError(f"{yaml_path}: no top-level 'task: NAME' line")
