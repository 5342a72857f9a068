"""Tiny DeepSeek-V4 on CUDA (gpu-marked): decode steps replayed in CUDA graphs give the eager steps' tokens and
logprobs, and transformers' greedy tokens and prompt logprobs (``v4_fixture``'s checkpoint: every layer type, hash and
top-k MoE through the Triton fused MoE with its SwiGLU clamp, two hyper-connection streams).

float32 (dtype explicit: "auto" runs a float32 checkpoint in bf16 on CUDA). Prompt steps run eagerly
(``prompt_graphs = False``); decode steps of one token and of 1 + 3 tokens (draft verification) replay graphs.
The CPU half of what these pin (the decode path at padded graph sizes, under the host-read guard, the graphs'
state slot buffer) is in ``test_deepseek_v4_decode.py``.
"""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams

from ..engine.test_multi_token_steps import KnownTokensDrafter, with_drafter
from .test_deepseek_v4 import NEW_TOKENS, _assert_matches_hf, ckpt  # noqa: F401  (ckpt: the fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TOL = 1e-4


def _run(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=1,
                            prompt_logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _token_logprobs(out) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])


def _count_replays(llm: LLM, monkeypatch) -> list[int]:
    """The q of every decode-graph replay."""
    graphs = llm.engine.runner.graphs
    replays: list[int] = []
    replay = graphs.replay

    def counted(size: int, q: int = 1) -> torch.Tensor:
        replays.append(q)
        return replay(size, q)

    monkeypatch.setattr(graphs, "replay", counted)
    return replays


def test_cuda_float32_decode_graphs_match_eager_and_hf(ckpt, monkeypatch):  # noqa: F811
    path, _, prompts, _, _ = ckpt
    assert torch.get_float32_matmul_precision() == "highest"
    llm = LLM(str(path), device="cuda", dtype="float32")
    runner = llm.engine.runner
    assert runner.graphs is not None and (1, 1) in runner.graphs.graphs, \
        "decode CUDA graphs were not captured (see the capture warning in the log)"
    assert runner.graphs.state_slots is not None and runner.prefill_graphs is None
    replays = _count_replays(llm, monkeypatch)
    graphed = _run(llm, prompts)
    assert len(replays) >= NEW_TOKENS - 1, f"only {len(replays)} decode steps replayed a CUDA graph"
    _assert_matches_hf(graphed, ckpt, "CUDA graphs")
    eager = _run(LLM(str(path), device="cuda", dtype="float32", enforce_eager=True), prompts)
    _assert_matches_hf(eager, ckpt, "CUDA eager")
    for i, (g, e) in enumerate(zip(graphed, eager)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"prompt {i}: graphs and eager diverge"
        worst = float((_token_logprobs(g) - _token_logprobs(e)).abs().max())
        assert worst < TOL, f"prompt {i}: decode logprobs of graphs and eager differ by {worst:.3g}"


def test_cuda_draft_verification_replays_four_token_graphs_and_matches_hf(ckpt, monkeypatch):  # noqa: F811
    """Steps of 1 + 3 tokens (every third draft spoiled) replay the graphs captured at 4 tokens a sequence."""
    path, _, prompts, greedy, _ = ckpt
    drafter = KnownTokensDrafter({tuple(p): g for p, g in zip(prompts, greedy)}, spoil_every=3, vocab=128)
    llm = with_drafter(LLM(str(path), device="cuda", dtype="float32"), drafter, k=3)
    graphs = llm.engine.runner.graphs
    assert (1, 4) in graphs.graphs and (1, 1) in graphs.graphs, "4-token decode graphs were not captured"
    replays = _count_replays(llm, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_matches_hf(outs, ckpt, "drafts in graphs")
    assert 4 in replays and drafter.proposed > 20


def test_cuda_deterministic_mode_runs_eagerly_and_matches_hf(ckpt):  # noqa: F811
    """``eager_when_deterministic``: the mode keeps V4's per-sequence path, which no graph can hold."""
    path, _, prompts, _, _ = ckpt
    llm = LLM(str(path), device="cuda", dtype="float32", deterministic=True)
    assert llm.engine.runner.graphs is None
    _assert_matches_hf(_run(llm, prompts[:3]), ckpt, "deterministic", [0, 1, 2])
