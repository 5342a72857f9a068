"""DeepSeek-V4 prefix caching: a hit at a block end restores the state slot from the block (``BoundaryStateSpec``).

The tiny checkpoint of ``v4_fixture`` (sliding, CSA rate 4 + indexer, HCA rate 16; window 8) with 16-token blocks.
A second turn of a conversation hits the first turn's blocks, the last of them filled by a decode step (its rows
copied from the rings after the step), a sibling prompt hits blocks filled inside a prompt step (captured during
the forward); each continues exactly: greedy tokens identical to a cold run and to transformers, and the sampled
tokens' fp32 logprobs within 1e-4 of both. The same through chunked prefill, the decode graph buffers, draft
verification and preemption; the tokens a hit computes do not grow with the prefix.
"""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from tests.models.hf_reference import record_preemptions

from ..engine.test_multi_token_steps import KnownTokensDrafter, with_drafter
from .test_deepseek_v4 import _through_graph_buffers
from .v4_fixture import write_checkpoint

transformers = pytest.importorskip("transformers")

BS = 16
NEW = 10


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v4-prefix")
    hf = write_checkpoint(transformers, path)
    gen = torch.Generator().manual_seed(3)
    return path, hf, torch.randint(2, 128, (200,), generator=gen).tolist()


def _params(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=0)


def _run(llm: LLM, prompts: list[list[int]], n: int = NEW) -> list[tuple[list[int], list[float], int]]:
    """(tokens, their logprobs, prompt tokens served from the cache) per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(n), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                          o.outputs[0].logprobs)],
             o.num_cached_tokens) for o in outs]


def _assert_exact(hf, prompt: list[int], ours, cold, mode: str) -> None:
    """Greedy tokens as a cold run's and transformers' (teacher-forced: each is the argmax after the ones before),
    logprobs within 1e-4 of both."""
    tokens, logprobs, _ = ours
    assert tokens == cold[0], f"{mode}: a {len(prompt)}-token prompt diverged from the cold run"
    assert max(abs(a - b) for a, b in zip(logprobs, cold[1])) < 1e-4, mode
    with torch.no_grad():
        rows = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    assert rows.argmax(-1).tolist() == tokens, f"{mode}: not transformers' greedy tokens"
    worst = float((rows.gather(1, torch.tensor(tokens)[:, None])[:, 0] - torch.tensor(logprobs)).abs().max())
    assert worst < 1e-4, f"{mode}: logprobs differ from transformers' by {worst:.3g}"


def _conversation(v4, llm: LLM) -> None:
    """Turn 1 (70 tokens, 12 generated: 81 computed) then, together, turn 2 (turn 1, its answer, 9 more: a hit of
    80 tokens, the 5th block filled by a decode step) and a sibling of turn 1 (its first 48 tokens, 5 more: a hit
    of 48, blocks filled inside turn 1's prompt step)."""
    path, hf, tokens = v4
    turn1 = tokens[:70]
    first = _run(llm, [turn1], 12)[0]
    turn2, sibling = turn1 + first[0] + tokens[100:109], turn1[:48] + tokens[120:125]
    ours = _run(llm, [turn2, sibling])
    assert [o[2] for o in ours] == [80, 48]
    cold_llm = LLM(str(path), block_size=BS, enable_prefix_caching=False)
    cold = [_run(cold_llm, [turn1], 12)[0], *_run(cold_llm, [turn2, sibling])]
    for prompt, out, ref, mode in zip([turn1, turn2, sibling], [first, *ours], cold,
                                      ["turn 1", "turn 2", "sibling"]):
        _assert_exact(hf, prompt, out, ref, mode)


MODES = {"whole": {}, "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
         "async": {"async_scheduling": True}, "worker process": {"distributed_executor_backend": "mp"}}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_hit_restores_the_state_slot_and_continues_as_cold_and_hf(v4, mode):
    """Chunked: 16-token chunks end on block ends, so those boundaries come from the rings after each step. Async:
    a block is offered while the step that filled it may still run (the restore queues behind it). Worker
    process: the slot is restored there, from the block ids of the request's NewRequestData."""
    llm = LLM(str(v4[0]), block_size=BS, **MODES[mode])
    try:
        _conversation(v4, llm)
    finally:
        llm.engine.shutdown()


def test_a_hit_through_the_decode_graph_buffers(v4, monkeypatch):
    """Decode steps replayed from the graphs' buffers: the block a decode step filled is kept from the rings after
    the replay (the graph itself writes no boundary)."""
    llm = LLM(str(v4[0]), block_size=BS)
    replays = _through_graph_buffers(llm, monkeypatch)
    _conversation(v4, llm)
    assert replays


def test_a_hit_after_draft_verification(v4):
    """Steps of 1 + 3 tokens (every third draft spoiled): a block end inside a step's drafts is kept from the
    rings (window + 3 rows), and a rejected draft's rows are written again before the block is offered."""
    path, hf, tokens = v4
    turn1 = tokens[:45]
    cold = _run(LLM(str(path), block_size=BS, enable_prefix_caching=False), [turn1], 30)[0]
    turn2 = turn1 + cold[0] + tokens[150:153]
    drafter = KnownTokensDrafter({tuple(turn1): cold[0]}, spoil_every=3, vocab=128)
    llm = with_drafter(LLM(str(path), block_size=BS), drafter, k=3)
    _assert_exact(hf, turn1, _run(llm, [turn1], 30)[0], cold, "drafts")
    assert drafter.proposed > 10
    second = _run(llm, [turn2], 4)[0]
    assert second[2] == 64
    _assert_exact(hf, turn2, second, _run(LLM(str(path), block_size=BS, enable_prefix_caching=False), [turn2],
                                          4)[0], "after drafts")


def test_a_preempted_request_resumes_from_its_own_cached_blocks(v4):
    """7 blocks of 16 tokens: two 40-token prompts grow into 3 + 3 + 1 blocks each, so one is preempted; its
    computed blocks stay cached (until the other reuses them), and its second admission hits those still there and
    restores its slot from the last."""
    path, hf, tokens = v4
    prompts = [tokens[:40], tokens[50:90]]
    llm = LLM(str(path), block_size=BS, num_kv_blocks=7)
    preempted = record_preemptions(llm)
    hits = []
    kv = llm.engine.kv_manager
    lookup = kv.get_computed_blocks
    kv.get_computed_blocks = lambda request: (lambda got: (hits.append(got[1]), got)[1])(lookup(request))
    ours = _run(llm, prompts, 30)
    assert preempted and max(hits) >= 2 * BS, f"no preemption or no hit on the resumed request: {hits}"
    cold = _run(LLM(str(path), block_size=BS, enable_prefix_caching=False), prompts, 30)
    for prompt, out, ref in zip(prompts, ours, cold):
        _assert_exact(hf, prompt, out, ref, "preempted")


def test_a_hit_computes_the_same_few_tokens_whatever_the_prefix(v4):
    """Prefixes of 2 and 10 blocks, then the same prefixes with another 5-token tail: each second prompt computes
    its 5 tail tokens only (its slot restored from the prefix's last block), and continues as a cold run."""
    path, hf, tokens = v4
    llm = LLM(str(path), block_size=BS)
    firsts = [tokens[:32] + tokens[190:195], tokens[:160] + tokens[190:195]]
    seconds = [tokens[:32] + tokens[180:185], tokens[:160] + tokens[180:185]]
    _run(llm, firsts, 1)
    computed: dict[str, int] = {}  # tokens each request's steps computed
    schedule = llm.engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        for rid, n in out.plan.num_scheduled_tokens.items():
            computed[rid] = computed.get(rid, 0) + n
        return out

    llm.engine.scheduler.schedule = counting_schedule
    ours = _run(llm, seconds, 4)
    assert [len(p) - o[2] for p, o in zip(seconds, ours)] == [5, 5]
    assert sorted(computed.values()) == [5 + 3, 5 + 3]  # the tail, then 3 decode steps (the 4th token is sampled)
    cold = _run(LLM(str(path), block_size=BS, enable_prefix_caching=False), seconds, 4)
    for prompt, out, ref in zip(seconds, ours, cold):
        _assert_exact(hf, prompt, out, ref, "long prefix")
